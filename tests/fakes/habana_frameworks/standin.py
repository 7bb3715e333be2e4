"""The stand-in's own state: recorded calls, the simulated device memory, the compilation
events, the execution mode. Tests read and set these; the server never imports this."""

from __future__ import annotations

import atexit
import functools
import inspect
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

GiB = 1 << 30


@dataclass
class Call:
    name: str
    arguments: dict[str, Any]


@dataclass
class Device:
    """One simulated Gaudi: a memory limit, what is in use, compilations so far."""

    limit: int = 4 * GiB  # small, so a KV cache sized from free memory stays small on the CPU
    in_use: int = 0
    compilations: int = 0
    compile_seconds: float = 0.0


CALLS: list[Call] = []
DEVICE = Device()
# PT_HPU_LAZY_MODE, read once at import like the bridge does (1: lazy, 0: eager + compile)
LAZY = os.environ.get("PT_HPU_LAZY_MODE", "1") != "0"
# Lazy mode: forwards run since the last mark_step (their ops wait in one graph), and the
# graphs (recipes) compiled so far.
state: dict[str, Any] = {"pending_forwards": 0, "recipes": set()}


def reset(limit: int = 4 * GiB, lazy: bool | None = None) -> None:
    """A fresh device (between tests in one process)."""
    global DEVICE, LAZY
    CALLS.clear()
    DEVICE = Device(limit=limit)
    if lazy is not None:
        LAZY = lazy
    state["pending_forwards"] = 0
    state["recipes"] = set()


def calls(name: str) -> list[Call]:
    return [c for c in CALLS if c.name == name]


def compiled(seconds: float = 0.0) -> None:
    """One GRAPH_COMPILATION event, as the bridge's event dispatcher reports it."""
    DEVICE.compilations += 1
    DEVICE.compile_seconds += seconds


def documented(name: str, reference: Callable[..., Any]) -> Callable[[F], F]:
    """Checks each call against ``reference``'s signature (the bridge's documented one) and
    records it under ``name``; a call the real function would refuse raises TypeError."""
    signature = inspect.signature(reference)

    def wrap(impl: F) -> F:
        @functools.wraps(impl)
        def checked(*args: Any, **kwargs: Any) -> Any:
            try:
                bound = signature.bind(*args, **kwargs)
            except TypeError as exc:
                raise TypeError(f"{name}{signature}: {exc}") from None
            bound.apply_defaults()
            CALLS.append(Call(name, dict(bound.arguments)))
            return impl(*args, **kwargs)

        return checked  # type: ignore[return-value]

    return wrap



def _dump(path: str) -> None:
    """Writes the calls (names and plain arguments) for a test in another process."""
    plain = (str, int, float, bool, type(None))
    records = [{"name": c.name,
                "arguments": {k: v for k, v in c.arguments.items() if isinstance(v, plain)}}
               for c in CALLS]
    summary = {"calls": records, "compilations": DEVICE.compilations,
               "in_use": DEVICE.in_use, "limit": DEVICE.limit}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(summary, f)


if os.environ.get("HABANA_STANDIN_RECORD"):  # a server process under test
    atexit.register(_dump, os.environ["HABANA_STANDIN_RECORD"])
