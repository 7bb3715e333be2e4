"""One long prompt against hpu-serve and vLLM's CPU backend: time to first token and peak RSS.

    PYTHONPATH=. .venv/bin/python benchmarks/compare/long_prompt.py [--prompt-len 8000]
        [--hpu-serve-config LABEL=FLAGS ...] [--baseline-tree DIR] [--no-vllm]

Each server is started alone (nothing else runs while it is measured) with a context long
enough for the prompt, warmed with one short request, then sent one streamed completion of
``--prompt-len`` random token ids (the same ids for every server) for 8 tokens. Reported:
TTFT, the resident memory of the server's whole process tree before the request (after
warmup) and its peak while the prompt is computed (sampled every 50 ms), and the
difference: what the long prompt costs in memory (activations, KV, scratch).
``--baseline-tree DIR`` adds hpu-serve run from another checkout (e.g. ``git archive main |
tar -x -C DIR``), started from that folder with this interpreter: a before/after in one run.
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from compare import ROOT, Server, free_port, hf_folder_from_gguf, python_has, vllm_server

from server.models.loader import resolve_model_source


def tree_rss_mib(pid: int) -> float:
    """Resident memory of ``pid`` and all its descendants (vLLM runs three processes)."""
    pids, frontier = {pid}, [pid]
    while frontier:
        parent = frontier.pop()
        try:
            children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
        except OSError:
            continue
        for child in map(int, children):
            if child not in pids:
                pids.add(child)
                frontier.append(child)
    total = 0
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def first_token_seconds(server: Server, prompt: list[int], max_tokens: int) -> float:
    body = {"model": server.model, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "ignore_eos": True}
    start = time.perf_counter()
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=3600) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                if json.loads(line[6:])["choices"][0].get("text"):
                    return time.perf_counter() - start
    raise RuntimeError(f"{server.name} streamed no text")


def measure(server: Server, log_dir: Path, prompt: list[int]) -> dict:
    server.start(log_dir)
    try:
        first_token_seconds(server, prompt[:32], 2)  # warm (vLLM compiles lazily too)
        assert server.proc is not None
        before = tree_rss_mib(server.proc.pid)
        peak, done = [before], threading.Event()

        def sample() -> None:
            while not done.is_set():
                peak.append(tree_rss_mib(server.proc.pid))
                time.sleep(0.05)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        ttft = first_token_seconds(server, prompt, 8)
        done.set()
        sampler.join()
        return {"server": server.name, "ttft_s": ttft, "rss_before_mib": before,
                "rss_peak_mib": max(peak), "rss_added_mib": max(peak) - before,
                "ready_s": server.ready_s}
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-len", type=int, default=8000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--hpu-serve-config", action="append", default=[],
                        metavar="LABEL=FLAGS", help="another hpu-serve server with FLAGS")
    parser.add_argument("--baseline-tree", default=None, metavar="DIR",
                        help="also run hpu-serve from this checkout (A/B against another commit)")
    parser.add_argument("--no-vllm", dest="vllm", action="store_false")
    parser.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    parser.add_argument("--vllm-kv-cache-gib", type=int, default=4)
    parser.add_argument("--result-file", default=None)
    args = parser.parse_args()
    context = args.prompt_len + 64
    rng = random.Random(0)  # the same ids for every server
    prompt = [rng.randrange(100, 40000) for _ in range(args.prompt_len)]
    configs = [("hpu-serve", [])] + [
        (f"hpu-serve[{label}]", shlex.split(flags))
        for label, _, flags in (spec.partition("=") for spec in args.hpu_serve_config)]
    servers = [Server(name, [sys.executable, "-m", "server", "serve", "--host", "127.0.0.1",
                             "--port", str(port := free_port()), "--max-model-len",
                             str(context), *flags], port) for name, flags in configs]
    if args.baseline_tree:  # `python -m server` imports from the current folder: start there
        port = free_port()
        servers.insert(0, Server("hpu-serve[baseline]", [
            "bash", "-c", 'cd "$0" && exec "$@"', args.baseline_tree, sys.executable, "-m",
            "server", "serve", "--host", "127.0.0.1", "--port", str(port), "--max-model-len",
            str(context)], port, env={"PYTHONPATH": args.baseline_tree}))
    log_dir = Path(tempfile.mkdtemp(prefix="hpu-serve-long-prompt-"))
    if args.vllm and python_has(args.vllm_python, "vllm"):
        source = resolve_model_source(None)
        folder = hf_folder_from_gguf(source.folder, source.gguf_file,
                                     ROOT / ".bench-cache" / "hf-model")
        vargs = argparse.Namespace(shared_prefix_len=0, input_len=args.prompt_len,
                                   output_len=8, vllm_python=args.vllm_python,
                                   vllm_kv_cache_gib=args.vllm_kv_cache_gib,
                                   threads=args.threads)
        servers.append(vllm_server(vargs, folder))
    print(f"{args.prompt_len}-token prompt, 8 output tokens; logs in {log_dir}")
    print(f"{'server':<24} {'TTFT s':>8} {'RSS before MiB':>15} {'peak MiB':>9} {'added MiB':>10}")
    results = []
    for server in servers:
        r = measure(server, log_dir, prompt)
        results.append(r)
        print(f"{r['server']:<24} {r['ttft_s']:>8.2f} {r['rss_before_mib']:>15.0f} "
              f"{r['rss_peak_mib']:>9.0f} {r['rss_added_mib']:>10.0f}", flush=True)
        if args.result_file:
            Path(args.result_file).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
