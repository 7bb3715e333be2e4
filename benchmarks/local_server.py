"""A `python -m server serve` of this checkout on a free loopback port, for the benchmarks that
drive a real server (abuse.py, soak.py): started, waited for until /health answers, stopped
with SIGTERM."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str | None, flags: list[str], timeout_s: float = 300.0,
                 env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str, Path]:
    """(process, base URL, log file) once the server answers /health; raises with the log if
    it exits first or is not healthy within ``timeout_s``. ``env``: the server's whole
    environment (None: this process's)."""
    port = free_port()
    log = Path(tempfile.mkdtemp()) / "server.log"
    cmd = [sys.executable, "-m", "server", "serve", *([model] if model else []),
           "--host", "127.0.0.1", "--port", str(port), *flags]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited early:\n{log.read_text()}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url, log
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise TimeoutError(f"the server was not healthy in {timeout_s:.0f} s; log: {log}")


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM (the server drains), then a kill after 60 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
