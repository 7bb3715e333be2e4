"""Served embeddings, hpu-serve against vLLM's CPU backend, same folder, same cores, one run.

    PYTHONPATH=. python benchmarks/compare/embeddings_serving.py [--size small|base]
        [--dtype bfloat16] [--texts 256] [--batch-size 32] [--text-len 128] [--rounds 4]

Both servers serve the same sentence-transformers folder (a random BERT at bge-small sizes,
mean pooling, Normalize; built once by ``benchmarks/embeddings.py``'s builder into
``.bench-cache/``), with the same dtype, ``--max-model-len``, ``--max-num-seqs`` and step
token budget; vLLM's OpenMP threads are bound to the first ``--threads`` cores (hpu-serve uses
torch's default, all of them). ``--hpu-serve-config LABEL=FLAGS`` adds an hpu-serve
configuration. All are up at once, idle while another is measured.

* Throughput: ``--texts`` texts of exactly ``--text-len`` tokens, sent to ``/v1/embeddings``
  as requests of ``--batch-size`` texts, one request in flight; texts/s per round. Rounds
  alternate the order (A/B, then B/A) so a noisy host's drift falls on both.
* Latency: one 32-token text per request, median over ``--latency-repeat`` requests.
* Texts per CPU-second: the throughput texts over the CPU time the server's processes used
  meanwhile (all of vLLM's processes); on a host loaded by other jobs the wall-clock rates
  measure each server's share of the cores as much as its work, this does not.

Before timing, the two servers' vectors for the same texts are compared (min cosine), so a
mismatch in what is served shows. Prints per-round lines, then medians and ratios (the
pooling issue's targets: >= 1.5x throughput, latency <= vLLM's). vLLM comes from
``.venv-vllm`` (``WITH_VLLM=1 benchmarks/compare/setup_peers.sh``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from compare import Server, free_port, python_has, thread_envs  # noqa: E402
from embeddings import build_folder, make_texts  # noqa: E402


def servers(args: argparse.Namespace, folder: Path) -> list[Server]:
    common = ["--runner", "pooling", "--dtype", args.dtype,
              "--max-model-len", str(args.max_model_len),
              "--max-num-seqs", str(args.batch_size),
              "--max-num-batched-tokens", str(args.batch_size * args.max_model_len),
              "--host", "127.0.0.1"]
    ours, theirs = thread_envs(args.threads, 1, pin=not args.no_pin)
    configs = [("hpu-serve", [])]
    for spec in args.hpu_serve_config:
        label, _, flags = spec.partition("=")
        configs.append((f"hpu-serve[{label}]", shlex.split(flags)))
    found = [Server(name, [sys.executable, "-m", "server", "serve", str(folder), *common,
                           *flags, "--port", str(port := free_port())], port, env=ours)
             for name, flags in configs]
    if not python_has(args.vllm_python, "vllm"):
        sys.exit(f"vllm: not installed at {args.vllm_python} "
                 "(WITH_VLLM=1 benchmarks/compare/setup_peers.sh)")
    found.append(Server("vllm", [
        args.vllm_python, str(Path(__file__).with_name("vllm_cpu_cli.py")), "serve",
        str(folder), *common, "--port", str(port := free_port())], port,
        env=theirs))
    return found


def embed(client: httpx.Client, server: Server, texts: list[str]) -> list[list[float]]:
    return embed_usage(client, server, texts)[0]


def embed_usage(client: httpx.Client, server: Server, texts: list[str]
                ) -> tuple[list[list[float]], int]:
    """The vectors and the prompt tokens the server counted."""
    reply = client.post(server.url + "/v1/embeddings",
                        json={"model": server.model, "input": texts})
    reply.raise_for_status()
    body = reply.json()
    return [row["embedding"] for row in body["data"]], body["usage"]["prompt_tokens"]


def group_cpu_seconds(pgid: int) -> float:
    """CPU seconds used so far by the live processes of a process group (a server and the
    processes it started: vLLM's API server, engine core and workers), from /proc (Linux;
    0 elsewhere). On a host loaded by other jobs, texts per CPU-second compares the two
    servers' work without counting how much of the cores each was given."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # pgrp, after state and ppid
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


def throughput(client: httpx.Client, server: Server, texts: list[str], batch: int
               ) -> tuple[float, float]:
    """(texts per second, texts per CPU-second of the server's processes)."""
    assert server.proc is not None
    cpu = group_cpu_seconds(server.proc.pid)
    began = time.perf_counter()
    for i in range(0, len(texts), batch):
        embed(client, server, texts[i:i + batch])
    seconds = time.perf_counter() - began
    used = group_cpu_seconds(server.proc.pid) - cpu
    return len(texts) / seconds, len(texts) / used if used > 0 else float("nan")


def latency(client: httpx.Client, server: Server, text: str, repeat: int) -> float:
    embed(client, server, [text])
    times = []
    for _ in range(repeat):
        began = time.perf_counter()
        embed(client, server, [text])
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def min_cosine(a: list[list[float]], b: list[list[float]]) -> float:
    def cos(x: list[float], y: list[float]) -> float:
        dot = sum(p * q for p, q in zip(x, y))
        return dot / (sum(p * p for p in x) ** 0.5 * sum(q * q for q in y) ** 0.5)
    return min(cos(x, y) for x, y in zip(a, b))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=["small", "base"], default="small")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--texts", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--text-len", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--latency-repeat", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2, help="OpenMP threads of each server")
    parser.add_argument("--no-pin", action="store_true",
                        help="vLLM's threads float (nobind) like hpu-serve's: for a loaded host")
    parser.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm/bin/python"))
    parser.add_argument("--result-file", default=None)
    parser.add_argument("--hpu-serve-config", action="append", default=[],
                        metavar="LABEL=FLAGS",
                        help="one more hpu-serve server, hpu-serve[LABEL], started with FLAGS, "
                             "e.g. 'compile=--execution-mode compile' (repeatable)")
    args = parser.parse_args()
    work = ROOT / ".bench-cache" / f"embed-bert-{args.size}"
    folder = work / "st"
    if not (folder / "modules.json").exists():
        work.mkdir(parents=True, exist_ok=True)
        build_folder(work, args.size)
    texts = make_texts(args.texts, args.text_len, seed=0)
    short = make_texts(1, 32, seed=1)[0]
    print(f"BERT-{args.size} random weights ({folder}), {args.dtype}; {args.texts} texts x "
          f"{args.text_len} tokens in requests of {args.batch_size}; latency: one 32-token "
          f"text, median of {args.latency_repeat}", flush=True)
    found = servers(args, folder)
    rates: dict[str, list[float]] = {s.name: [] for s in found}
    per_cpu: dict[str, list[float]] = {s.name: [] for s in found}
    lat: dict[str, list[float]] = {s.name: [] for s in found}
    logs = tempfile.mkdtemp(prefix="hpu-serve-compare-")
    print(f"server logs in {logs}", flush=True)
    with httpx.Client(timeout=600) as client:
        try:
            for server in found:
                server.start(Path(logs))
                print(f"{server.name}: ready in {server.ready_s:.1f} s", flush=True)
            # the same texts to each: the same vectors and the same token counts, or the
            # comparison is not of the same work
            checked = {s.name: embed_usage(client, s, texts[:4] + [short]) for s in found}
            vllm_vectors = checked["vllm"][0]
            for name, (vectors, tokens) in checked.items():
                print(f"{name}: {tokens} prompt tokens for 4 x {args.text_len} + 32; min "
                      f"cosine to vllm {min_cosine(vectors, vllm_vectors):.5f}", flush=True)
            for r in range(args.rounds):
                order = found if r % 2 == 0 else found[::-1]
                for server in order:
                    rate, cpu_rate = throughput(client, server, texts, args.batch_size)
                    rates[server.name].append(rate)
                    per_cpu[server.name].append(cpu_rate)
                    lat[server.name].append(
                        latency(client, server, short, args.latency_repeat))
                print(f"round {r + 1} ({' then '.join(s.name for s in order)}): " + ", ".join(
                    f"{n} {rates[n][-1]:.2f} texts/s ({per_cpu[n][-1]:.2f} per CPU-s), "
                    f"{lat[n][-1] * 1e3:.1f} ms"
                    for n in rates) + f"; load average {os.getloadavg()[0]:.1f}", flush=True)
        finally:
            for server in found:
                server.stop()
    med = {n: (statistics.median(rates[n]), statistics.median(lat[n])) for n in rates}
    print(f"\nmedians over {args.rounds} rounds (best round in brackets):")
    for name, (rate, seconds) in med.items():
        print(f"  {name:<24} {rate:7.2f} texts/s ({max(rates[name]):.2f})  "
              f"{statistics.median(per_cpu[name]):6.2f} texts per CPU-second  latency "
              f"{seconds * 1e3:7.1f} ms ({min(lat[name]) * 1e3:.1f})")
    their_rate, their_lat = med["vllm"]
    for name, (rate, seconds) in med.items():
        if name != "vllm":
            cpu_ratio = (statistics.median(per_cpu[name])
                         / statistics.median(per_cpu["vllm"]))
            print(f"  {name} / vllm: throughput {rate / their_rate:.2f}x (target >= 1.5x), "
                  f"per CPU-second {cpu_ratio:.2f}x, latency {seconds / their_lat:.2f} "
                  "(target <= 1)")
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(
            {"args": vars(args), "texts_per_s": rates, "texts_per_cpu_s": per_cpu,
             "latency_s": lat,
             "ready_s": {s.name: s.ready_s for s in found}}, indent=2))


if __name__ == "__main__":
    main()
