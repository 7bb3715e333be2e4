"""Start-up cost of the real daemon, cold vs warm: the default configuration (eager CPU with
the fused kernels and the GGUF tokenizer, built on first start into HPU_SERVE_CACHE_DIR), and
the compiled mode with torch's compile cache on disk (TORCHINDUCTOR_CACHE_DIR).

    python benchmarks/startup.py [--model PATH] [--compile-args ...]

Each start is `python -m server serve` on a loopback port, timed from spawn to the first
`/health` 200 (the port opens only after warmup); warmup seconds and compilation counts come
from the server's own /metrics. Cold = empty cache directory, warm = the same directory again.
On Gaudi the same applies to the HPU recipe cache (PT_HPU_RECIPE_CACHE_CONFIG).
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_once(model: str | None, flags: list[str], env: dict[str, str]) -> dict[str, float]:
    port = free_port()
    argv = [sys.executable, "-m", "server", "serve", *([model] if model else []),
            "--host", "127.0.0.1", "--port", str(port), *flags]
    started = time.monotonic()
    proc = subprocess.Popen(argv, env={**os.environ, **env}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(proc.stderr.read()[-3000:])
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        ready = time.monotonic() - started
        text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    finally:
        proc.terminate()
        proc.wait(60)
    out = {"ready_s": ready, "warmup_s": 0.0, "compilations": 0.0, "buckets": 0.0}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "hpu_serve:warmup_seconds":
                out["warmup_s"] = s.value
            elif s.name == "hpu_serve:graph_compilations_total":
                out["compilations"] += s.value
            elif s.name == "hpu_serve:warmup_buckets" and s.labels.get("state") == "warmed":
                out["buckets"] += s.value
    return out


def show(label: str, r: dict[str, float]) -> None:
    print(f"{label:<34} ready {r['ready_s']:7.1f} s  warmup {r['warmup_s']:7.1f} s  "
          f"buckets {r['buckets']:4.0f}  compilations {r['compilations']:4.0f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: embedded SmolLM2")
    parser.add_argument("--compile-args", nargs="*",
                        default=["--max-num-seqs", "16", "--max-model-len", "512"],
                        help="limits for the compiled runs (each bucket is one compilation)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="hpu-serve-cache-") as cache_dir:
        env = {"HPU_SERVE_CACHE_DIR": cache_dir}
        cold = start_once(args.model, [], env)
        show("default, cold (kernels built)", cold)  # and the tokenizer converted
        warm = start_once(args.model, [], env)
        show("default, warm (restart)", warm)
    print(f"default warm / cold: ready {warm['ready_s'] / cold['ready_s']:.2f}x")
    with tempfile.TemporaryDirectory(prefix="inductor-cache-") as cache:
        env = {"TORCHINDUCTOR_CACHE_DIR": cache}
        flags = ["--execution-mode", "compile", *args.compile_args]
        cold = start_once(args.model, flags, env)
        show("compile, cold cache", cold)
        warm = start_once(args.model, flags, env)
        show("compile, warm cache (restart)", warm)
        size = sum(f.stat().st_size for f in Path(cache).rglob("*") if f.is_file())
    print(f"warm / cold: ready {warm['ready_s'] / cold['ready_s']:.2f}x, "
          f"warmup {warm['warmup_s'] / cold['warmup_s']:.2f}x "
          f"(cache {size / 2**20:.0f} MiB, flags {' '.join(flags)})")


if __name__ == "__main__":
    main()
