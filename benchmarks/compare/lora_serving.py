"""Multi-LoRA serving throughput, hpu-serve against vLLM's CPU backend, in one run.

    PYTHONPATH=. python benchmarks/compare/lora_serving.py [--concurrency 16] [--rounds 2]

Both servers serve the same base (the embedded SmolLM2-135M, saved once as a HF folder) and
the same 4 random PEFT adapters (rank 16, every projection), bf16, 4 adapter slots, from
``--lora-modules``. The workload is ``hpu-serve bench``'s (seeded ~200-token prompts, 128
streamed output tokens, EOS ignored) split evenly over the 4 adapters, ``--concurrency`` in
flight in all, the same ``--max-model-len`` on both. Both servers are up at once and take
turns round by round (A/B, then B/A), so a noisy host's drift falls on both. Prints each
server's output tok/s per round and the median ratio (the issue's target: hpu-serve >= 1x
vLLM). vLLM comes from ``.venv-vllm`` (``WITH_VLLM=1 benchmarks/compare/setup_peers.sh``);
without it only hpu-serve runs.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from compare import (  # noqa: E402
    Server,
    free_port,
    hf_folder_from_gguf,
    python_has,
    thread_envs,
)
from lora_decode import write_adapter  # noqa: E402

from server.bench.cli import load_tokenizer  # noqa: E402
from server.bench.client import Endpoint  # noqa: E402
from server.bench.runner import run_workload  # noqa: E402
from server.bench.workload import BenchRequest, WorkloadSpec, synthetic_requests  # noqa: E402
from server.models.loader import load_model_config, resolve_model_source  # noqa: E402

ADAPTERS = 4


def servers(args: argparse.Namespace, folder: Path, modules: list[str]) -> list[Server]:
    lora = ["--enable-lora", "--max-loras", str(ADAPTERS), "--max-lora-rank", str(args.rank),
            "--max-num-seqs", str(args.concurrency), "--max-model-len", str(args.max_model_len),
            "--lora-modules", *modules]
    ours, theirs = thread_envs(args.threads, 4, pin=not args.no_pin)
    found = [Server("hpu-serve", [
        sys.executable, "-m", "server", "serve", str(folder), "--dtype", "bfloat16",
        "--host", "127.0.0.1", "--port", str(port := free_port()), *lora], port, env=ours)]
    if python_has(args.vllm_python, "vllm"):
        found.append(Server("vllm", [
            args.vllm_python, str(Path(__file__).with_name("vllm_cpu_cli.py")), "serve",
            str(folder), "--dtype", "bfloat16",
            "--host", "127.0.0.1", "--port", str(port := free_port()), *lora,
        ], port, env=theirs))
    else:
        print(f"vllm: not installed at {args.vllm_python}; hpu-serve only", file=sys.stderr)
    return found


def tokens_per_s(server: Server, requests: list[BenchRequest], concurrency: int) -> float:
    """Output tok/s of ``requests`` sent round-robin to the adapters, ``concurrency`` in
    flight in all (each adapter's share in its own stream of ``concurrency / 4``)."""
    endpoints = [Endpoint(server.url, f"a{i}") for i in range(ADAPTERS)]
    shares = [requests[i::ADAPTERS] for i in range(ADAPTERS)]

    async def run_all() -> int:
        summaries = await asyncio.gather(*(
            run_workload(e, share, max_concurrency=max(1, concurrency // ADAPTERS),
                         progress=False) for e, share in zip(endpoints, shares)))
        failed = [e for s, _ in summaries for e in s.errors]
        if failed:
            raise RuntimeError(f"{server.name}: {len(failed)} requests failed: {failed[:3]}")
        return sum(s.output_tokens for s, _ in summaries)

    for e in endpoints:  # untimed: each adapter's first use (its copy into a slot)
        asyncio.run(run_workload(e, requests[:1], progress=False))
    began = time.perf_counter()
    tokens = asyncio.run(run_all())
    return tokens / (time.perf_counter() - began)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=200)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=2, help="OpenMP threads of each server")
    parser.add_argument("--no-pin", action="store_true",
                        help="vLLM's threads float (nobind) like hpu-serve's: for a loaded host")
    parser.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm/bin/python"))
    parser.add_argument("--work-dir", default=str(ROOT / ".bench-cache" / "lora-serving"))
    args = parser.parse_args()
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    source = resolve_model_source(None)
    assert source.gguf_file, "the embedded model is a GGUF"
    folder = hf_folder_from_gguf(source.folder, source.gguf_file, work / "hf-model")
    cfg = load_model_config(resolve_model_source(str(folder)))
    paths = [write_adapter(work / f"a{i}", cfg, args.rank, i) for i in range(ADAPTERS)]
    modules = [f"a{i}={p}" for i, p in enumerate(paths)]
    tokenizer = load_tokenizer(str(folder))
    results: dict[str, list[float]] = {}
    found = servers(args, folder, modules)
    logs = tempfile.mkdtemp(prefix="hpu-serve-compare-")
    print(f"server logs in {logs}", flush=True)
    try:
        for server in found:
            server.start(Path(logs))
            print(f"{server.name}: ready in {server.ready_s:.1f} s", flush=True)
        for rnd in range(args.rounds):
            spec = WorkloadSpec(args.num_prompts, args.input_len, args.output_len, seed=rnd)
            requests = synthetic_requests(spec, tokenizer, set())
            for server in found if rnd % 2 == 0 else found[::-1]:
                rate = tokens_per_s(server, requests, args.concurrency)
                results.setdefault(server.name, []).append(rate)
                print(f"{server.name} round {rnd}: {rate:.1f} output tok/s "
                      f"(concurrency {args.concurrency}, {ADAPTERS} adapters)", flush=True)
    finally:
        for server in found:
            server.stop()
    medians = {name: statistics.median(rates) for name, rates in results.items()}
    line = ", ".join(f"{name} {rate:.1f}" for name, rate in medians.items())
    if "vllm" in medians:
        line += f"; hpu-serve / vllm {medians['hpu-serve'] / medians['vllm']:.2f}x"
    print(f"median output tok/s: {line}")


if __name__ == "__main__":
    main()
