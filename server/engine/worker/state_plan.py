"""The state cache a hybrid model (Qwen3-Next, Qwen3.5) serves with, on the runner's side:
its size, what it takes out of the KV budget, its tensors, and what these models cannot be
served with (see server/engine/core/state_cache.py for the slots' owners and
server/hpu/state_cache.py for the tensors).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from server.config import EngineConfig, SchedulerLimits
from server.hpu.state_cache import LayerState, StateShape, allocate_state_cache, state_cache_bytes
from server.models.loader import LoadedModel

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StatePlan:
    """One slot per sequence the batch can hold (``--max-num-seqs``), plus the padding slot
    (``num_slots``), of every linear layer's state tensors."""

    shapes: list[StateShape]
    num_slots: int

    @property
    def pad_slot(self) -> int:
        return self.num_slots

    @property
    def nbytes(self) -> int:
        return state_cache_bytes(self.shapes, self.num_slots)

    def allocate(self, device: torch.device) -> list[LayerState]:
        caches = allocate_state_cache(self.shapes, self.num_slots, device)
        logger.info("State cache: %d slots (max_num_seqs) + 1 padding slot, %d "
                    "linear-attention layers, %.1f KiB per slot, %.2f MiB in all",
                    self.num_slots, len(self.shapes),
                    sum(s.bytes_per_slot for s in self.shapes) / 2**10, self.nbytes / 2**20)
        return caches

    def kv_budget(self, budget: int, bytes_per_block: int) -> int:
        """What ``budget`` leaves for KV blocks once the state cache is taken out; an error
        naming ``--max-num-seqs`` where that is not even two blocks (one and the padding)."""
        if self.nbytes + 2 * bytes_per_block > budget:
            raise RuntimeError(
                f"the state cache ({self.num_slots} slots, one per --max-num-seqs, "
                f"{self.nbytes / 2**30:.2f} GiB) leaves no room for KV blocks in the "
                f"{budget / 2**30:.2f} GiB budget: lower --max-num-seqs or raise the budget "
                "(VLLM_CPU_KVCACHE_SPACE / --gpu-memory-utilization)")
        return budget - self.nbytes


def plan_state_cache(config: EngineConfig, loaded: LoadedModel, limits: SchedulerLimits
                     ) -> StatePlan | None:
    """The state cache of a hybrid model, None for the others. Refuses what such a model
    cannot serve with, and says that prefix caching does not apply to it (a cached block
    holds keys and values, not the linear layers' state after it)."""
    if not loaded.config.is_hybrid:
        return None
    if config.speculative.settings is not None:
        raise ValueError("--speculative-config is not supported for hybrid (linear-attention) "
                         "models: a rejected draft token would already be in their "
                         "recurrent state")
    logger.info("Prefix caching: off for this hybrid model (its linear-attention state after "
                "a prefix is not cached: every prompt is computed whole)%s",
                "; --enable-prefix-caching does not apply"
                if config.cache.enable_prefix_caching else "")
    return StatePlan(loaded.model.state_shapes(loaded.dtype), limits.max_num_seqs)
