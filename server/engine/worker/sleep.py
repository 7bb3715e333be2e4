"""A model runner's device memory, emptied and refilled in place (sleep mode), and its
weights swapped in place (weight reload).

Memory is freed by resizing tensor *storages* to zero bytes and back, never by replacing
tensors: every module attribute, KV cache view and compiled graph keeps pointing at the same
tensor objects, so ``torch.compile`` graphs stay valid (their guards see the same shapes,
strides and dtypes) and nothing recompiles after a wake. Captured device graphs (CUDA, HPU)
hold raw addresses instead, which a storage resize changes: the runner re-captures them.

oneDNN-packed linear weights (eager CPU only) are opaque tensors without a storage to
resize: they are freed by dropping the module's reference and given the freshly packed
tensor at wake. Eager mode has no graph that could hold the old one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from server.config import EngineConfig, ExecutionMode
from server.hpu.kv_cache import KVCache
from server.hpu.platform import Platform
from server.models.config import ModelConfig
from server.models.loader import (
    LoadedModel,
    ModelSource,
    gguf_parse,
    load_int4_weights,
    load_model,
    load_model_config,
    resolve_model_source,
)

logger = logging.getLogger(__name__)


class WeightsState(enum.Enum):
    RESIDENT = "resident"  # on the device, as served
    OFFLOADED = "offloaded"  # copied to host memory, device storages empty
    DISCARDED = "discarded"  # storages empty, nothing kept: reload from the files


class WeightMismatchError(ValueError):
    """New weights that do not fit the served model (names, shapes or dtypes differ)."""


@dataclass(eq=False)
class TensorSlot:
    """One tensor of the model, where the module holds it."""

    name: str
    owner: object  # a module, or a packed copy (dataclass) of one
    attr: str
    tensor: torch.Tensor
    # a tensor without a storage (oneDNN's packed layout)
    opaque: bool = False
    # an opaque tensor freed by dropping it (level 2): ``tensor`` is then a meta stand-in
    dropped: bool = False

    def describe(self) -> str:
        return f"{tuple(self.tensor.shape)} {str(self.tensor.dtype).replace('torch.', '')}"

    def fits(self, other: TensorSlot) -> bool:
        return (other.tensor.shape == self.tensor.shape and other.tensor.dtype
                == self.tensor.dtype and other.opaque == self.opaque)


def tensor_slots(model: nn.Module) -> list[TensorSlot]:
    """Every tensor the model holds: parameters, buffers, plain tensor attributes (packed
    weights, int4 codes) and the tensors of packed copies held as dataclasses (the CPU
    kernels' bf16 / int4 / Q8_0 layouts), each object once (tied weights are one), in module
    order. A copy left out would keep serving the old weights after a reload."""
    slots: list[TensorSlot] = []
    seen: set[int] = set()

    def add(name: str, owner: object, attr: str, tensor: torch.Tensor | None) -> None:
        if tensor is None or id(tensor) in seen:
            return
        seen.add(id(tensor))
        slots.append(TensorSlot(name, owner, attr, tensor,
                                opaque=tensor.layout != torch.strided))

    for prefix, module in model.named_modules():
        base = f"{prefix}." if prefix else ""
        held = [*module._parameters.items(), *module._buffers.items(),
                *((k, v) for k, v in vars(module).items() if isinstance(v, torch.Tensor))]
        for attr, tensor in held:
            add(base + attr, module, attr, tensor)
        for attr, pack in vars(module).items():
            if not dataclasses.is_dataclass(pack) or isinstance(pack, type):
                continue
            for field in dataclasses.fields(pack):
                value = getattr(pack, field.name)
                if isinstance(value, torch.Tensor):
                    add(f"{base}{attr}.{field.name}", pack, field.name, value)
    return slots


def _storages(tensors: Iterable[torch.Tensor]) -> list[tuple[torch.UntypedStorage, int]]:
    """The distinct storages under ``tensors`` (views share one) with their sizes."""
    found: dict[int, tuple[torch.UntypedStorage, int]] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in found:
            found[storage.data_ptr()] = (storage, storage.nbytes())
    return list(found.values())


def _opaque_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class DeviceMemory:
    """The model's weights and the KV cache, each freed and restored as a whole.

    ``offload_to_host``: level 1 copies the weights to host memory before freeing them
    (accelerators); on CPU they already are in host memory and level 1 keeps them.
    """

    def __init__(self, model: nn.Module, kv_caches: list[KVCache], offload_to_host: bool,
                 device: torch.device) -> None:
        self.device = device
        self.offload_to_host = offload_to_host
        self._slots = tensor_slots(model)
        self._weights = _storages(s.tensor for s in self._slots if not s.opaque)
        self._kv = _storages(t for layer in kv_caches for t in layer)
        self.kv_cache_bytes = sum(n for _, n in self._kv)
        self.weights_bytes = sum(n for _, n in self._weights) + sum(
            _opaque_bytes(s.tensor) for s in self._slots if s.opaque)
        self.weights = WeightsState.RESIDENT
        self.kv_resident = True
        self._backup: list[torch.UntypedStorage] = []

    @property
    def resident(self) -> bool:
        return self.weights is WeightsState.RESIDENT and self.kv_resident

    def release_kv(self) -> None:
        for storage, _ in self._kv:
            storage.resize_(0)
        self.kv_resident = False

    def restore_kv(self) -> None:
        """Back to full size, zero-filled: masked slots flow through matmuls, and stale
        blocks of another model must not survive (see ``allocate_kv_cache``)."""
        if self.kv_resident:
            return
        for storage, nbytes in self._kv:
            storage.resize_(nbytes)
            if storage.device.type == "cpu":  # 2 MiB pages again, as at start-up
                from server.hpu.cpu.host_memory import advise_huge_pages, collapse_huge_pages

                advise_huge_pages(storage)
                collapse_huge_pages(storage)
            storage.fill_(0)
        self.kv_resident = True

    def offload_weights(self) -> None:
        """Level 1: host copies of the weight storages, then the device's freed. A no-op
        where the weights live in host memory already."""
        if self.weights is not WeightsState.RESIDENT or not self.offload_to_host:
            return
        self._backup = []
        for storage, nbytes in self._weights:
            self._backup.append(torch.UntypedStorage(nbytes, device="cpu").copy_(storage))
            storage.resize_(0)
        self.weights = WeightsState.OFFLOADED

    def discard_weights(self) -> None:
        """Level 2: every weight freed, nothing kept."""
        if self.weights is WeightsState.DISCARDED:
            return
        for storage, _ in self._weights:
            storage.resize_(0)
        for slot in self._slots:
            if slot.opaque and not slot.dropped:  # no storage: drop the module's reference
                setattr(slot.owner, slot.attr, torch.empty(0).to_mkldnn())
                slot.tensor = torch.empty(slot.tensor.shape, dtype=slot.tensor.dtype,
                                          device="meta")
                slot.dropped = True
        self._backup = []
        self.weights = WeightsState.DISCARDED

    @property
    def needs_files(self) -> bool:
        """Whether restoring the weights needs them read from the files (level 2)."""
        return self.weights is WeightsState.DISCARDED

    def restore_weights(self) -> None:
        """Back from the host copies (level 1); a no-op when they never left."""
        if self.weights is WeightsState.OFFLOADED:
            for (storage, nbytes), backup in zip(self._weights, self._backup):
                storage.resize_(nbytes)
                storage.copy_(backup)
            self._backup = []
            self.weights = WeightsState.RESIDENT
        elif self.weights is WeightsState.DISCARDED:
            raise RuntimeError("the weights were discarded (level 2): load them")

    @torch.no_grad()
    def load_weights(self, fresh: nn.Module) -> None:
        """Copies every tensor of ``fresh`` (a model built and prepared the same way) into
        the served tensors, in place; whatever state the weights were in, they are resident
        after. Checked first, so a mismatch changes nothing."""
        pairs = self.match(fresh)
        self._backup = []
        for storage, nbytes in self._weights:
            if storage.nbytes() != nbytes:
                storage.resize_(nbytes)
        for slot, new in pairs:
            if slot.dropped:  # discarded: take the fresh packing
                setattr(slot.owner, slot.attr, new)
                slot.tensor, slot.dropped = new, False
            else:
                slot.tensor.copy_(new)
        self.weights = WeightsState.RESIDENT

    def match(self, fresh: nn.Module) -> list[tuple[TensorSlot, torch.Tensor]]:
        """(served slot, new tensor) pairs; WeightMismatchError naming what differs."""
        new = {s.name: s for s in tensor_slots(fresh)}
        served = {s.name: s for s in self._slots}
        problems = [f"{n} is missing" for n in served if n not in new]
        problems += [f"{n} is not in the served model" for n in new if n not in served]
        for name, slot in served.items():
            other = new.get(name)
            if other is not None and not slot.fits(other):
                problems.append(f"{name} is {other.describe()}, served {slot.describe()}")
        if problems:
            more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
            raise WeightMismatchError("the new weights do not fit the served model: "
                                      + "; ".join(problems[:5]) + more)
        return [(slot, new[slot.name].tensor) for slot in self._slots]

    @contextlib.contextmanager
    def freeing(self) -> Iterator[None]:
        """Whatever is freed inside goes back to the system as it is freed (host memory:
        the heap tops glibc would keep too, see host_memory.py), the rest after."""
        if self.device.type == "cpu":
            from server.hpu.cpu.host_memory import returning_freed_memory

            with returning_freed_memory():
                yield
            return
        yield
        self.release_to_system()

    def release_to_system(self) -> None:
        """Freed memory back to the system: the host heap's free pages (glibc keeps them
        otherwise, see host_memory.py) and the accelerator allocator's cache."""
        if self.device.type == "cpu":
            from server.hpu.cpu.host_memory import release_free_host_memory

            release_free_host_memory()
            return
        accelerator = getattr(torch, "accelerator", None)
        if accelerator is not None and hasattr(accelerator, "empty_cache"):
            accelerator.empty_cache()


# Settings that may differ between checkpoints of one architecture: the weights still fit.
_FREE_SETTINGS = frozenset({"eos_token_ids", "checkpoint_dtype", "quant"})


class WeightLoader:
    """Reads a model's weights from files into a fresh model prepared exactly as the served
    one was (same dtype, device, layouts), for level 2 wakes and ``/reload_weights``.
    ``path``: where the served weights come from (the last reload's, once there is one)."""

    def __init__(self, config: EngineConfig, platform: Platform, mode: ExecutionMode,
                 served: ModelConfig, dtype: torch.dtype, max_model_len: int,
                 cache_dir: Path) -> None:
        self.config = config
        self.platform = platform
        self.mode = mode
        self.served = served
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.cache_dir = cache_dir
        self.path = config.model.model

    def check(self, path: str | None) -> ModelSource:
        """The source at ``path``, its architecture compared with the served one first
        (from config.json or the GGUF header: nothing is read or allocated yet)."""
        source = resolve_model_source(path)
        found = load_model_config(source)
        diffs = [f"{f.name} {getattr(found, f.name)!r} (served {getattr(self.served, f.name)!r})"
                 for f in dataclasses.fields(self.served) if f.name not in _FREE_SETTINGS
                 and getattr(found, f.name) != getattr(self.served, f.name)]
        if diffs:
            raise WeightMismatchError(f"{path}: another architecture than the served model: "
                                      + ", ".join(diffs))
        return source

    def load(self, path: str | None) -> LoadedModel:
        """A fresh model with the weights at ``path``, prepared for this platform."""
        # the check, the weights and the 4-bit codes read one parse of a GGUF file
        _parse = gguf_parse(resolve_model_source(path))
        source = self.check(path)
        loaded = load_model(source, str(self.dtype).replace("torch.", ""),
                            self.platform.device)
        int4 = (functools.partial(load_int4_weights, source, loaded.config)
                if source.is_gguf and self.config.model.quantization != "none" else None)
        self.platform.prepare_model(loaded.model, self.mode, self.config.device, int4,
                                    self.cache_dir)
        loaded.model.serve_context(self.max_model_len)
        return loaded
