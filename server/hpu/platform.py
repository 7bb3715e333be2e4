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

    def prepare_process(self) -> None:
        """Process-wide settings the platform wants before the model runs."""
        if self.name == "cpu":
            from server.hpu.host_memory import tune_host_allocator

            tune_host_allocator()  # activations live in host memory: keep pages mapped


PLUGIN_GROUP = "hpu_serve.platform_plugins"
_BUILTIN_ORDER = ("hpu", "cuda")


def hpu_plugin() -> Platform | None:
    return Platform("hpu", torch.device("hpu")) if _hpu_available() else None


def cuda_plugin() -> Platform | None:
    if not torch.cuda.is_available():
        return None
    return Platform("cuda", torch.device("cuda", torch.cuda.current_device()))


def cpu_plugin() -> Platform | None:
    return Platform("cpu", torch.device("cpu"))


def discover_platforms() -> dict[str, Platform | None]:
    """Every platform registered under the ``hpu_serve.platform_plugins`` entry-point group
    (the built-ins register the same way as a third party would), mapped to the Platform its
    plugin function returns, or None where it is not available on this machine."""
    from importlib.metadata import entry_points

    found: dict[str, Platform | None] = {}
    for ep in entry_points(group=PLUGIN_GROUP):
        try:
            found[ep.name] = ep.load()()
        except Exception:  # a broken plugin must not take the server down
            found[ep.name] = None
    if "cpu" not in found:  # running from a source tree without installed metadata
        found.update(hpu=hpu_plugin(), cuda=cuda_plugin(), cpu=cpu_plugin())
    return found


def detect_platform(requested: str = "auto") -> Platform:
    """``auto`` prefers HPU, then CUDA, then a third-party platform, then CPU."""
    found = discover_platforms()
    if requested != "auto":
        platform = found.get(requested)
        if platform is None:
            known = ", ".join(sorted(found))
            raise RuntimeError(f"--device {requested}: not available here (platforms: {known})")
        return platform
    for name in _BUILTIN_ORDER:
        if found.get(name) is not None:
            return found[name]  # type: ignore[return-value]
    others = sorted(n for n, p in found.items() if p is not None and n != "cpu")
    return found[others[0]] if others else found["cpu"]  # type: ignore[return-value]


def _hpu_available() -> bool:
    if importlib.util.find_spec("habana_frameworks") is None:
        return False
    try:
        import habana_frameworks.torch.hpu as hthpu

        return bool(hthpu.is_available())
    except Exception:  # a broken vendor install must not stop CPU/CUDA serving
        return False
