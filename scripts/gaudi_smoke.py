"""Gaudi smoke test: serve, warm up, benchmark, and prove nothing compiled while serving.

    scripts/gaudi_smoke.sh [--model /models/Llama-3.1-8B-Instruct] [--device hpu]

For the embedded model, then for ``--model`` if given: starts ``hpu-serve serve`` on a free
loopback port, waits for the port (warmup completes before it opens), runs ``hpu-serve
bench`` at each ``--concurrency``, reads ``/metrics`` and the warmup log, stops the server,
and prints a report to paste into an issue. Exits 1 if any graph was compiled while
serving, if a request failed, or if the server did not start. ``--device cpu`` runs the
same on any machine (this is how CI tests the script).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families


@dataclass
class RunReport:
    model: str
    execution_mode: str = "?"
    warmup_seconds: float = 0.0
    buckets: dict[str, dict[str, float]] = field(default_factory=dict)
    graph_memory_gib: dict[str, float] = field(default_factory=dict)
    serving_compilations: float = 0.0
    bench: dict[int, dict] = field(default_factory=dict)
    failed_requests: int = 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bridge_version() -> str:
    for dist in ("habana-torch-plugin", "habana_frameworks"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return "not installed"


def metric_samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [(s.name, s.labels, s.value) for family in text_string_to_metric_families(text)
            for s in family.samples]


def read_metrics(report: RunReport, text: str) -> None:
    for name, labels, value in metric_samples(text):
        if name == "hpu_serve:warmup_seconds":
            report.warmup_seconds = value
        elif name == "hpu_serve:warmup_buckets":
            report.buckets.setdefault(labels["phase"], {})[labels["state"]] = value
        elif name == "hpu_serve:graph_compilations_total" and labels["stage"] == "serving":
            report.serving_compilations += value


def read_log(report: RunReport, log: str) -> None:
    mode = re.search(r"Execution mode: (.+)", log)
    report.execution_mode = mode.group(1).strip() if mode else "?"
    for phase, used in re.findall(r"Graph/(\w+) captured:\d+ \([\d.]+%\) used_mem:([\d.]+) GiB",
                                  log):
        report.graph_memory_gib[phase.lower()] = float(used)


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before serving")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the server was not ready within {timeout:.0f} s")


def smoke(model: str | None, args: argparse.Namespace, workdir: Path) -> RunReport:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    name = model or "embedded SmolLM2-135M-Instruct"
    log_path = workdir / f"server-{port}.log"
    command = [args.python, "-m", "server", "serve", *([model] if model else []),
               "--host", "127.0.0.1", "--port", str(port), "--device", args.device,
               *args.server_arg]
    report = RunReport(name)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(url, proc, args.startup_timeout)
        for concurrency in args.concurrency:
            result = workdir / f"bench-{port}-{concurrency}.json"
            bench_command = [
                args.python, "-m", "server", "bench", "--base-url", url,
                "--num-prompts", str(args.num_prompts or max(4, 4 * concurrency)),
                "--max-concurrency", str(concurrency), "--input-len", str(args.input_len),
                "--output-len", str(args.output_len), "--no-progress",
                "--result-file", str(result),
                *(["--tokenizer", model] if model else []),  # default: the embedded one
            ]
            bench = subprocess.run(bench_command, capture_output=True, text=True, check=False)
            if not result.exists():
                raise RuntimeError(f"hpu-serve bench failed:\n{bench.stdout}\n{bench.stderr}")
            record = json.loads(result.read_text())
            report.bench[concurrency] = record
            report.failed_requests += record["failed"]
        read_metrics(report, httpx.get(url + "/metrics", timeout=10).text)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
    read_log(report, log_path.read_text(errors="replace"))
    return report


def format_report(device: str, reports: list[RunReport]) -> str:
    lines = ["## hpu-serve Gaudi smoke test",
             f"device: {device}; bridge: {bridge_version()}; host: {platform.node()}; "
             f"python {platform.python_version()}"]
    for r in reports:
        lines += ["", f"### {r.model}",
                  f"execution mode: {r.execution_mode}; warmup {r.warmup_seconds:.1f} s",
                  "buckets (planned / warmed / captured): " + ", ".join(
                      f"{phase} {b.get('planned', 0):.0f} / {b.get('warmed', 0):.0f} / "
                      f"{b.get('captured', 0):.0f}" for phase, b in sorted(r.buckets.items())
                      if phase in ("prefill", "decode")),
                  "graph memory: " + (", ".join(f"{p} {g:.2f} GiB"
                                                for p, g in sorted(r.graph_memory_gib.items()))
                                      or "no graphs captured"),
                  f"compilations while serving: {r.serving_compilations:.0f}",
                  "",
                  "| concurrency | output tok/s | TTFT p50 ms | ITL p50 ms | failed |",
                  "|---:|---:|---:|---:|---:|"]
        for c, b in sorted(r.bench.items()):
            lines.append(f"| {c} | {b['output_throughput']:.1f} | {b['ttft_ms']['p50']:.1f} "
                         f"| {b['itl_ms']['p50']:.1f} | {b['failed']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="a second model to run (HF folder/.gguf)")
    parser.add_argument("--device", default="hpu")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--num-prompts", type=int, default=None,
                        help="per run (default: 4 x concurrency)")
    parser.add_argument("--input-len", type=int, default=200)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--startup-timeout", type=float, default=3600.0,
                        help="seconds for load + warmup (a cold Gaudi recipe cache is slow)")
    parser.add_argument("--server-arg", action="append", default=[],
                        help="extra `hpu-serve serve` argument (repeat)")
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--report-file", default=None, help="also write the report here")
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="hpu-serve-smoke-"))
    reports = []
    for model in [None] + ([args.model] if args.model else []):
        try:
            reports.append(smoke(model, args, workdir))
        except (RuntimeError, TimeoutError) as exc:
            print(f"FAILED: {model or 'embedded model'}: {exc} (logs in {workdir})",
                  file=sys.stderr)
            return 1
    text = format_report(args.device, reports)
    print(text)
    if args.report_file:
        Path(args.report_file).write_text(text + "\n")
    problems = verdict(reports)
    for problem in problems:
        print(f"FAILED: {problem}", file=sys.stderr)
    return 1 if problems else 0


def verdict(reports: list[RunReport]) -> list[str]:
    """What makes the smoke test fail: compilations while serving, failed requests."""
    problems = []
    for r in reports:
        if r.serving_compilations > 0:
            problems.append(f"{r.model}: {r.serving_compilations:.0f} graph compilations while "
                            "serving (a bucket was missed or the warmup is incomplete)")
        if r.failed_requests > 0:
            problems.append(f"{r.model}: {r.failed_requests} requests failed")
    return problems

if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
