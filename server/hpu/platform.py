"""Platforms: a device kind and everything the engine asks of it.

A platform is a :class:`Platform` subclass found through the ``hpu_serve.platform_plugins``
entry-point group: the built-in ``hpu`` (``gaudi.py``), ``cuda`` (``cuda.py``) and ``cpu``
(``cpu/``) register the same way a third-party package (TPU, Neuron...) would, and bring
their own memory query, default execution mode, graph runners, model preparation and
``torch.distributed`` backend name. Nothing here branches on a platform's name.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar

import torch

from server.config import MIN_BATCHED_TOKENS, CacheConfig, DeviceConfig, ExecutionMode
from server.hpu.counters import DeviceCounters
from server.hpu.graph_runner import CompiledRunner, EagerRunner, ForwardFn, GraphRunner
from server.hpu.layer_ops import TorchLayerOps

PLUGIN_GROUP = "hpu_serve.platform_plugins"
# The built-ins' entry points, as pyproject.toml declares them.
BUILTIN_PLUGINS = {"hpu": "server.hpu.gaudi:hpu_plugin", "cuda": "server.hpu.cuda:cuda_plugin",
                   "cpu": "server.hpu.cpu.platform:cpu_plugin"}
# Preference of ``--device auto`` among the built-ins; third parties come before the CPU.
_BUILTIN_ORDER = ("hpu", "cuda")


class Platform:
    """The base platform: eager or ``torch.compile`` execution, a KV cache sized from free
    device memory. Subclasses override what their device does differently.

    A plugin is a zero-argument callable registered under ``hpu_serve.platform_plugins``
    that returns an instance, or None where the device is not present.
    """

    name: ClassVar[str] = "abstract"
    # torch.distributed backend of this device (for tensor parallelism)
    dist_backend: ClassVar[str] = "gloo"
    # what ``--execution-mode auto`` means here
    default_mode: ClassVar[ExecutionMode] = ExecutionMode.COMPILE
    # the step's token budget with chunked prefill when --max-num-batched-tokens is unset
    default_max_num_batched_tokens: ClassVar[int] = MIN_BATCHED_TOKENS
    # modes this platform can run (AUTO is resolved first)
    supported_modes: ClassVar[frozenset[ExecutionMode]] = frozenset(
        {ExecutionMode.EAGER, ExecutionMode.COMPILE})

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.device})"

    def free_memory_bytes(self) -> tuple[int, int]:
        """(free, total) device memory; (0, 0) where the device cannot tell."""
        return 0, 0

    def kv_cache_budget_bytes(self, cache: CacheConfig) -> int:
        """Bytes the KV cache may take: what is free now, less the share of the device
        that ``--gpu-memory-utilization`` keeps back."""
        free, total = self.free_memory_bytes()
        return int(free - total * (1.0 - cache.gpu_memory_utilization))

    def prepare_process(self) -> None:
        """Process-wide settings wanted before the model is loaded."""

    def prepare_rank(self, rank: int, world_size: int) -> None:
        """Tensor parallelism: this process serves one rank of ``world_size``, on its own
        device. ``rank`` is that device's index among the devices this process sees: the
        rank itself under the mp executor (all ranks on this host), 0 in a Ray actor (Ray
        shows it only its own device), the device Ray set aside for rank 0 in the server."""
        if world_size == 1 or self.device.type == "cpu":
            return
        self.device = torch.device(self.device.type, rank)
        accelerator = getattr(torch, "accelerator", None)
        if accelerator is not None and hasattr(accelerator, "set_device_index"):
            accelerator.set_device_index(rank)

    def resolve_mode(self, cfg: DeviceConfig) -> ExecutionMode:
        """The execution mode to run: ``--enforce-eager`` wins, ``auto`` is the default."""
        if cfg.enforce_eager:
            return ExecutionMode.EAGER
        mode = self.default_mode if cfg.execution_mode is ExecutionMode.AUTO else cfg.execution_mode
        if mode not in self.supported_modes:
            supported = ", ".join(sorted(m.value for m in self.supported_modes))
            raise ValueError(f"--execution-mode {mode} is not available on {self.name} "
                             f"(supported: {supported})")
        return mode

    def graph_runner(self, mode: ExecutionMode, forward: ForwardFn, counters: DeviceCounters,
                     model: torch.nn.Module, cfg: DeviceConfig) -> GraphRunner:
        """How ``forward`` runs in ``mode``. Compiled mode compiles one decoder layer per
        shape (identical layers share it) rather than the whole model."""
        if mode is ExecutionMode.EAGER:
            return EagerRunner(forward, counters)
        regions = list(getattr(model, "layers", [])) or None
        return CompiledRunner(forward, counters, regions=regions)

    def prepare_model(self, model: torch.nn.Module, mode: ExecutionMode, cfg: DeviceConfig,
                      int4_weights: Callable[[], Mapping[str, Any]] | None,
                      cache_dir: Path, decode_query: int = 1) -> TorchLayerOps:
        """Device-specific preparation of a loaded model before its KV cache exists (weight
        layouts, quantized paths); returns the layer ops the model should run.
        ``decode_query``: tokens per sequence of the largest decode step (a speculative
        verify step's k + 1; 1 without speculation)."""
        del model, mode, cfg, int4_weights, cache_dir, decode_query
        return TorchLayerOps()


def discover_platforms() -> dict[str, Platform | None]:
    """Every platform registered under ``hpu_serve.platform_plugins``, mapped to the
    Platform its plugin returns, or None where it is not available on this machine."""
    from importlib.metadata import entry_points

    found: dict[str, Platform | None] = {}
    for ep in entry_points(group=PLUGIN_GROUP):
        try:
            found[ep.name] = ep.load()()
        except Exception:  # a broken plugin must not take the server down
            found[ep.name] = None
    if "cpu" not in found:  # running from a source tree without installed metadata
        for name, target in BUILTIN_PLUGINS.items():
            module, _, function = target.partition(":")
            found[name] = getattr(importlib.import_module(module), function)()
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
        platform = found.get(name)
        if platform is not None:
            return platform
    others = sorted(n for n, p in found.items() if p is not None and n != "cpu")
    chosen = found[others[0]] if others else found["cpu"]
    assert chosen is not None, "the CPU platform is always available"
    return chosen
