"""Served n-gram speculative decoding, on vs off, on hpu-serve and on vLLM's CPU backend, one run.

    PYTHONPATH=. python benchmarks/compare/spec_serving.py [--k 3] [--rounds 2]
        [--max-tokens 128] [--dtype bfloat16]

Four servers, up at once: hpu-serve and vLLM, each without and with the same
``--speculative-config`` (``ngram``, ``--k`` tokens, prompt lookup 2-4), all on the same HF
folder (the embedded SmolLM2-135M, saved once as a HF folder in ``.bench-cache/``), the same
dtype, ``--max-model-len`` and a 1 GiB KV cache (``VLLM_CPU_KVCACHE_SPACE``, which both read);
``--threads`` OpenMP threads each (``--no-pin``: vLLM's float like hpu-serve's), and vLLM
gets the Intel OpenMP that ``vllm-cpu`` ships in ``LD_PRELOAD`` (its own warning says
speculation on CPU is much slower without it; ``--no-iomp`` leaves it out). The workload is
``benchmarks/spec_decode.py``'s input-grounded prompts (copy, quote, code edit) through
``/v1/chat/completions``, greedy, one request at a time (concurrency 1), output tokens from
``usage``. The servers take turns round by round, the order reversed every round. Prints each
server's output tok/s, speed-up of speculation per server, hpu-serve / vLLM ratios, vLLM's and
hpu-serve's acceptance from their /metrics counters, and whether each server's greedy texts
are the same with speculation on and off.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from compare import Server, free_port, hf_folder_from_gguf, python_has, thread_envs  # noqa: E402
from spec_decode import GROUNDED  # noqa: E402

from server.models.loader import resolve_model_source  # noqa: E402


def servers(args: argparse.Namespace, folder: Path) -> list[Server]:
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": args.k,
                       "prompt_lookup_min": args.lookup_min,
                       "prompt_lookup_max": args.lookup_max})
    common = [str(folder), "--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
              "--host", "127.0.0.1"]
    ours, theirs = thread_envs(args.threads, 1, pin=not args.no_pin)
    iomp = Path(args.vllm_python).parents[1] / "lib" / "libiomp5.so"
    if not args.no_iomp and iomp.exists():
        # vLLM warns that speculative decoding on CPU without Intel OpenMP preloaded
        # "will cause significant performance loss"; vllm-cpu ships the library
        theirs = {**theirs, "LD_PRELOAD": str(iomp)}
    if not python_has(args.vllm_python, "vllm"):
        sys.exit(f"vllm: not installed at {args.vllm_python} "
                 "(WITH_VLLM=1 benchmarks/compare/setup_peers.sh)")
    vllm = [args.vllm_python, str(Path(__file__).with_name("vllm_cpu_cli.py")), "serve"]
    found = []
    for name, argv, env in (("hpu-serve", [sys.executable, "-m", "server", "serve"], ours),
                            ("vllm", vllm, theirs)):
        for label, extra in (("", []), ("+ngram", ["--speculative-config", spec])):
            found.append(Server(name + label, [*argv, *common, *extra,
                                               "--port", str(port := free_port())], port,
                                env=env))
    return found


def chat(client: httpx.Client, server: Server, prompt: str, max_tokens: int) -> tuple[str, int]:
    reply = client.post(server.url + "/v1/chat/completions", json={
        "model": server.model, "temperature": 0.0, "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": prompt}]})
    reply.raise_for_status()
    body = reply.json()
    return body["choices"][0]["message"]["content"], body["usage"]["completion_tokens"]


def counters(client: httpx.Client, server: Server) -> tuple[float, float]:
    """(draft tokens, accepted tokens) from vLLM's spec-decode counters on /metrics."""
    text = client.get(server.url + "/metrics").text

    def total(name: str) -> float:
        return sum(float(v) for v in re.findall(
            rf"^vllm:{name}_total(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M))
    return total("spec_decode_num_draft_tokens"), total("spec_decode_num_accepted_tokens")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    parser.add_argument("--lookup-min", type=int, default=2)
    parser.add_argument("--lookup-max", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=2, help="OpenMP threads of each server")
    parser.add_argument("--no-pin", action="store_true",
                        help="vLLM's threads float (nobind) like hpu-serve's: for a loaded host")
    parser.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm/bin/python"))
    parser.add_argument("--result-file", default=None)
    parser.add_argument("--no-iomp", action="store_true",
                        help="do not preload vllm-cpu's libiomp5.so into the vLLM servers")
    args = parser.parse_args()
    source = resolve_model_source(None)
    assert source.gguf_file, "the embedded model is a GGUF"
    folder = hf_folder_from_gguf(source.folder, source.gguf_file,
                                 ROOT / ".bench-cache" / "hf-model")
    found = servers(args, folder)
    rates: dict[str, list[float]] = {s.name: [] for s in found}
    texts: dict[str, list[list[str]]] = {s.name: [] for s in found}
    logs = tempfile.mkdtemp(prefix="hpu-serve-compare-")
    print(f"server logs in {logs}", flush=True)
    with httpx.Client(timeout=600) as client:
        try:
            for server in found:
                server.start(Path(logs))
                print(f"{server.name}: ready in {server.ready_s:.1f} s", flush=True)
                chat(client, server, GROUNDED[0], 8)  # warm
            before = {s.name: counters(client, s) for s in found}
            for r in range(args.rounds):
                order = found if r % 2 == 0 else found[::-1]
                for server in order:
                    began, tokens, answers = time.perf_counter(), 0, []
                    for prompt in GROUNDED:
                        answer, n = chat(client, server, prompt, args.max_tokens)
                        answers.append(answer)
                        tokens += n
                    rates[server.name].append(tokens / (time.perf_counter() - began))
                    texts[server.name].append(answers)
                    print(f"round {r + 1} {server.name:<16} {rates[server.name][-1]:7.1f} "
                          f"output tok/s ({tokens} tokens)", flush=True)
            after = {s.name: counters(client, s) for s in found}
        finally:
            for server in found:
                server.stop()
    med = {n: statistics.median(v) for n, v in rates.items()}
    print(f"\nmedian output tok/s over {args.rounds} rounds, {len(GROUNDED)} input-grounded "
          f"prompts one at a time, up to {args.max_tokens} tokens each")
    for name in ("hpu-serve", "vllm"):
        spec = name + "+ngram"
        drafted = after[spec][0] - before[spec][0]
        accepted = after[spec][1] - before[spec][1]
        same = texts[name] == texts[spec]
        print(f"{name:<9} off {med[name]:7.1f}  ngram {med[spec]:7.1f}  speed-up "
              f"{med[spec] / med[name]:.2f}x  acceptance {accepted:.0f}/{drafted:.0f} = "
              f"{accepted / max(drafted, 1):.2f}  same greedy text on/off: {same}")
    print(f"hpu-serve / vllm: off {med['hpu-serve'] / med['vllm']:.2f}x, ngram "
          f"{med['hpu-serve+ngram'] / med['vllm+ngram']:.2f}x")
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(
            {"args": vars(args), "output_tok_per_s": rates, "texts": texts,
             "counters": {"before": before, "after": after},
             "ready_s": {s.name: s.ready_s for s in found}}, indent=2))


if __name__ == "__main__":
    main()
