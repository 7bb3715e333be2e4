"""``habana_frameworks.torch.hpu`` (also ``torch.hpu`` once the bridge is loaded): the
device, its memory, and HPU graphs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from habana_frameworks import standin
from habana_frameworks.torch.hpu import metrics  # noqa: F401 - a submodule of the bridge's


def is_available() -> bool:
    standin.CALLS.append(standin.Call("hpu.is_available", {}))
    return True


def device_count() -> int:
    return 1


def get_device_name(device: Any = None) -> str:
    return "GAUDI2 (stand-in)"


def synchronize() -> None:
    standin.CALLS.append(standin.Call("hpu.synchronize", {}))


def _reference_memory_stats(device=None):  # noqa: ANN001, ANN202 - the bridge's
    ...


@standin.documented("hpu.memory_stats", _reference_memory_stats)
def memory_stats(device: Any = None) -> dict[str, int]:
    dev = standin.DEVICE
    return {"Limit": dev.limit, "InUse": dev.in_use, "MaxInUse": dev.in_use}


@standin.documented("hpu.mem_get_info", _reference_memory_stats)
def mem_get_info(device: Any = None) -> tuple[int, int]:
    """(free, total) bytes: ``Limit - InUse`` and ``Limit``, as the bridge computes them."""
    dev = standin.DEVICE
    return dev.limit - dev.in_use, dev.limit


# -- HPU graphs ------------------------------------------------------------------------


def _input_hash(obj: Any) -> int:
    """The bridge's key for a captured graph: tensors by shape (and layout), containers by
    their items, anything else by ``hash()``; so a value the bridge cannot hash (a plain
    dataclass, say) fails here as it fails on a Gaudi."""
    if isinstance(obj, dict):
        return _input_hash(tuple(obj.items()))
    if isinstance(obj, (list, tuple)):
        return hash(tuple(_input_hash(item) for item in obj))
    if torch.is_tensor(obj):
        return hash((tuple(obj.shape), obj.dtype, obj.stride()))
    return hash(obj)


def _tensors(obj: Any) -> list[torch.Tensor]:
    """The user inputs the bridge can see: tensors reached through dicts, lists, tuples."""
    if isinstance(obj, dict):
        return [t for item in obj.items() for t in _tensors(item)]
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in _tensors(item)]
    return [obj] if torch.is_tensor(obj) else []


def _copy_to(dst: Any, src: Any) -> None:
    """The bridge's replay input copy: the same structure, tensors copied in place;
    anything else (an object's attributes included) keeps its value from the capture."""
    assert type(dst) is type(src), f"replay inputs changed type: {type(dst)} vs {type(src)}"
    if isinstance(dst, dict):
        for (dk, dv), (sk, sv) in zip(dst.items(), src.items()):
            assert dk == sk
            _copy_to(dv, sv)
    elif isinstance(dst, (list, tuple)):
        for d, s in zip(dst, src):
            _copy_to(d, s)
    elif torch.is_tensor(dst):
        dst.copy_(src)


@dataclass
class _Graph:
    inputs: tuple[tuple[Any, ...], dict[str, Any]]
    outputs: Any


def _reference_wrap(module, asynchronous=False, disable_tensor_cache=False,  # noqa: ANN001, ANN202
                    dry_run=False, max_graphs=None):
    ...


@standin.documented("hpu.wrap_in_hpu_graph", _reference_wrap)
def wrap_in_hpu_graph(module: torch.nn.Module, asynchronous: bool = False,
                      disable_tensor_cache: bool = False, dry_run: bool = False,
                      max_graphs: int | None = None) -> torch.nn.Module:
    """Replaces ``module.forward``: the first call per input shape captures a graph (one
    compilation, device memory for its buffers), later calls copy their tensors into the
    captured inputs and replay; ``bypass_hpu_graphs=True`` runs the module without graphs
    (lazy mode: a recipe compiled the first time each shape runs)."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError("wrap_in_hpu_graph expects a torch.nn.Module")
    graphs: dict[int, _Graph] = {}
    original: Callable[..., Any] = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        if kwargs.pop("bypass_hpu_graphs", False):
            return lazy_call(original, args, kwargs)
        key = _input_hash((args, kwargs))
        graph = graphs.get(key)
        if graph is None:
            if max_graphs is not None and len(graphs) == max_graphs:
                return lazy_call(original, args, kwargs)
            outputs = original(*args, **kwargs)  # the capture run
            standin.compiled()
            standin.DEVICE.in_use += sum(t.numel() * t.element_size()
                                         for t in _tensors((args, kwargs, outputs)))
            graphs[key] = _Graph((args, kwargs), outputs)
            standin.CALLS.append(standin.Call("hpu_graph.capture", {"key": key}))
            return outputs
        _copy_to(graph.inputs, (args, kwargs))
        standin.CALLS.append(standin.Call("hpu_graph.replay", {"key": key}))
        _copy_to(graph.outputs, original(*graph.inputs[0], **graph.inputs[1]))
        return graph.outputs

    module.forward = forward  # type: ignore[method-assign]
    module.clear_cache = graphs.clear  # type: ignore[assignment]
    return module


def lazy_call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A module run op by op in lazy mode: the ops join the graph that the next
    ``mark_step`` compiles (once per distinct graph) and runs. A forward without a
    ``mark_step`` before the next one makes a bigger, new graph: more compilations."""
    key = hash((_input_hash((args, kwargs)), standin.state["pending_forwards"]))
    if key not in standin.state["recipes"]:
        standin.state["recipes"].add(key)
        standin.compiled()
    standin.state["pending_forwards"] += 1
    return fn(*args, **kwargs)
