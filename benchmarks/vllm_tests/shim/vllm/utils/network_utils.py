"""``get_open_port``: a free loopback port, as vLLM's helper hands out."""

from __future__ import annotations

import socket


def get_open_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
