"""The runner's adapters: a host-memory LRU of loaded (checked) adapters and the assignment
of the device slots, step by step.

The scheduler never runs more distinct adapters than there are slots, so every batch finds
one slot per adapter it holds: one already holding it, a free one, or the least recently
used one holding an adapter this batch does not need (its weights are copied over in
place; no shape changes, no graph is built).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable

import torch

from server.config import LoRAConfig
from server.engine.lora.request import LoRARequest
from server.models.config import ModelConfig
from server.models.lora import LoRAAdapter, SlotWriter, load_peft_adapter

logger = logging.getLogger(__name__)


def lora_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    return model_dtype if name == "auto" else getattr(torch, name)


class LoRAManager:
    """Host cache (``max_cpu_loras`` adapters) and device slots (``max_loras``) of one
    model runner. ``model_config`` is the whole model's (adapters are checked against it,
    and cut into a rank's part by the slots under tensor parallelism).

    :meth:`load` may run on any thread (the files are read off the engine thread, see
    AsyncEngine.load_lora_adapter); the slots are only touched by :meth:`slots_for` and
    :meth:`remove`, on the engine thread, between steps."""

    def __init__(self, config: LoRAConfig, model_config: ModelConfig,
                 slots: SlotWriter) -> None:
        self.config = config
        self.model_config = model_config
        self.slots = slots
        self._lock = threading.Lock()  # guards the host cache
        self._host: OrderedDict[int, LoRAAdapter] = OrderedDict()  # LRU first
        self._paths: dict[int, str] = {}
        # slot (1..S) -> adapter id held, least recently used first
        self._slot_of: OrderedDict[int, int] = OrderedDict()
        self.num_slot_loads = 0

    def load(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter in host memory, read and checked first if it is not there (raises
        server.models.lora.AdapterError naming the problem)."""
        with self._lock:
            adapter = self._host.get(request.lora_int_id)
            if adapter is not None and self._paths.get(request.lora_int_id) == request.lora_path:
                self._host.move_to_end(request.lora_int_id)
                return adapter
        # read outside the lock: a slow disk holds up no other adapter
        adapter = load_peft_adapter(request.lora_path, self.model_config,
                                    self.config.max_lora_rank, self.slots.dtype)
        with self._lock:
            self._host[request.lora_int_id] = adapter
            self._host.move_to_end(request.lora_int_id)
            self._paths[request.lora_int_id] = request.lora_path
            while len(self._host) > self.config.cpu_capacity:
                dropped, _ = self._host.popitem(last=False)
                self._paths.pop(dropped, None)
        return adapter

    def remove(self, adapter_id: int) -> None:
        """Forgets an adapter (unloaded): host copy and device slot."""
        with self._lock:
            self._host.pop(adapter_id, None)
            self._paths.pop(adapter_id, None)
        for slot, held in list(self._slot_of.items()):
            if held == adapter_id:
                del self._slot_of[slot]
                self.slots.clear(slot)

    def slots_for(self, loras: Iterable[LoRARequest | None]) -> list[int]:
        """Each row's slot (0: no adapter), loading into slots what this batch needs."""
        rows = list(loras)
        needed = {r.lora_int_id: r for r in rows if r is not None}
        if len(needed) > self.slots.num_slots:
            raise RuntimeError(f"{len(needed)} adapters in one batch, {self.slots.num_slots} "
                               "slots (the scheduler admits no more than --max-loras)")
        held = {adapter: slot for slot, adapter in self._slot_of.items()}
        for adapter_id, request in needed.items():
            slot = held.get(adapter_id)
            if slot is None:
                slot = self._free_slot(set(needed))
                self.slots.load(slot, self.load(request))
                self.num_slot_loads += 1
                held[adapter_id] = slot
            self._slot_of[slot] = adapter_id
            self._slot_of.move_to_end(slot)
        return [0 if r is None else held[r.lora_int_id] for r in rows]

    def _free_slot(self, keep: set[int]) -> int:
        for slot in range(1, self.slots.num_slots + 1):
            if slot not in self._slot_of:
                return slot
        for slot, adapter_id in self._slot_of.items():  # least recently used first
            if adapter_id not in keep:
                del self._slot_of[slot]
                return slot
        raise RuntimeError("no LoRA slot free")  # slots_for checked the count
