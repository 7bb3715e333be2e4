"""Which device runs the model, and how much memory it has free.

The only place that imports vendor modules (``habana_frameworks``); importing the package
never requires them.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Platform:
    """A device kind and the handful of facts the engine needs from it."""

    name: str  # hpu | cuda | cpu
    device: torch.device

    def free_memory_bytes(self) -> tuple[int, int]:
        """(free, total) device memory; CPU reports nothing (the cache has an explicit bound)."""
        if self.name == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            return int(free), int(total)
        if self.name == "hpu":
            import habana_frameworks.torch as htorch  # noqa: F401

            free, total = torch.hpu.mem_get_info()  # type: ignore[attr-defined]
            return int(free), int(total)
        return 0, 0


def detect_platform(requested: str = "auto") -> Platform:
    """``auto`` prefers HPU, then CUDA, then CPU."""
    if requested in ("auto", "hpu") and _hpu_available():
        return Platform("hpu", torch.device("hpu"))
    if requested == "hpu":
        raise RuntimeError("--device hpu: habana_frameworks is not installed or sees no HPU")
    if requested in ("auto", "cuda") and torch.cuda.is_available():
        return Platform("cuda", torch.device("cuda", torch.cuda.current_device()))
    if requested == "cuda":
        raise RuntimeError("--device cuda: torch sees no CUDA device")
    return Platform("cpu", torch.device("cpu"))


def _hpu_available() -> bool:
    if importlib.util.find_spec("habana_frameworks") is None:
        return False
    try:
        import habana_frameworks.torch.hpu as hthpu

        return bool(hthpu.is_available())
    except Exception:  # a broken vendor install must not stop CPU/CUDA serving
        return False
