"""Start a real `python -m server serve` process on a free loopback port."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

MODEL_NAME = "SmolLM2-135M-Instruct"  # served name, so README examples run verbatim


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    port: int
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metric(self, name: str, default: float | None = None) -> float:
        """The value of ``name`` on /metrics, summed over its label sets; a series that is
        not there is an error unless a ``default`` is given."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(self.base_url + "/metrics", timeout=10).text
        values = [s.value for f in text_string_to_metric_families(text) for s in f.samples
                  if s.name == name]
        if not values and default is not None:
            return default
        assert values, f"no {name} series on /metrics"
        return sum(values)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()


FAULT_SERVER = str(Path(__file__).with_name("fault_server.py"))
STANDIN_SERVER = str(Path(__file__).with_name("standin_server.py"))


def start_server(model: str | None, *flags: str, env: dict[str, str] | None = None,
                 wait: bool = True, fault: str | None = None,
                 script: str | None = None) -> ServerProcess:
    """``fault``: run tests/fault_server.py with HPU_SERVE_TEST_FAULT set to it;
    ``script``: run that launcher (e.g. tests/standin_server.py) instead of ``-m server``."""
    port = free_port()
    log_path = Path(tempfile.mkdtemp()) / "server.log"
    if fault is not None:
        script = FAULT_SERVER
        env = dict(env or {}, HPU_SERVE_TEST_FAULT=fault)
    launcher = ["-m", "server"] if script is None else [script]
    if script is not None:
        env = dict(env or {}, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    args = [sys.executable, *launcher, "serve"] + ([model] if model else [])
    args += ["--host", "127.0.0.1", "--port", str(port), *flags]
    # One OpenMP thread unless a test asks for more: the tiny test models gain nothing from
    # a second, and its spin-waits take the core the other test worker needs.
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=full_env)
    server = ServerProcess(proc, port, log_path)
    if wait:
        wait_healthy(server)
    return server


def wait_healthy(server: ServerProcess, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"server exited early:\n{server.log()}")
        try:
            if httpx.get(server.base_url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"server not healthy in {timeout}s:\n{server.log()}")


TINY_FLAGS = ("--dtype", "float32", "--block-size", "16", "--max-num-seqs", "64",
              "--served-model-name", MODEL_NAME)
