"""The device side of multi-LoRA: ``max_loras`` fixed slots per layer and projection, ranks
padded to ``max_lora_rank``, so that a batch with any mix of adapters runs the same shapes
(and graphs) as one without any.

Per layer and site, ``A [P, S, R, in]`` and ``B^T [S, R, out]`` (each part's output columns
from its own ``R`` shrink rows: ops.py); slot ``s`` (1..S) is index ``s - 1``, a row of slot
0 (no adapter) is masked out (the PyTorch op) or skipped (the fused CPU kernel: ``kernel``,
where the layer ops are the fused CPU ones; ops.py's :func:`lora_dense` stays the
reference and the path of every other backend). Loading an adapter copies its weights into
a slot in place: no tensor is reallocated, so compiled or captured graphs keep reading the
same storage.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn

from server.models.config import ModelConfig
from server.models.lora.ops import kernel_rows, lora_dense, lora_kernel, slot_mask
from server.models.lora.peft import LoRAAdapter, LoRASite, SiteShape, site_layers, site_shapes


class LayerLoRA(nn.Module):
    """One decoder layer's slot stacks; ``apply`` adds each row's adapter to a projection's
    output."""

    def __init__(self, sites: dict[LoRASite, SiteShape], num_slots: int, rank: int,
                 dtype: torch.dtype, device: torch.device | None, kernel: bool = False
                 ) -> None:
        super().__init__()
        self.kernel = kernel
        for site, shape in sites.items():
            self.register_buffer(f"{site.value}_a", torch.zeros(
                len(shape.parts), num_slots, rank, shape.inputs, dtype=dtype,
                device=device), persistent=False)
            self.register_buffer(f"{site.value}_bt", torch.zeros(
                num_slots, rank, shape.outputs, dtype=dtype, device=device),
                persistent=False)
        self.parts = {site: shape.parts for site, shape in sites.items()}
        self.sites = frozenset(sites)

    def stacks(self, site: LoRASite) -> tuple[torch.Tensor, torch.Tensor]:
        return getattr(self, f"{site.value}_a"), getattr(self, f"{site.value}_bt")

    def apply(self, site: LoRASite, x: torch.Tensor, y: torch.Tensor,
              mask: torch.Tensor | None) -> torch.Tensor:
        """``y`` (the base projection of ``x``) plus each row's adapter delta; ``mask``
        from :meth:`LoRASlots.mask` (None: no row has an adapter)."""
        if mask is None or site not in self.sites:
            return y
        a, bt = self.stacks(site)
        x = x.reshape(-1, x.shape[-1]).to(a.dtype)
        if self.kernel:  # in place: y is the projection's own fresh output
            if y.dtype == a.dtype and y.is_contiguous():
                return lora_kernel(x, a, bt, mask, self.parts[site],
                                   y.view(-1, y.shape[-1])).view(y.shape)
            delta = y.new_zeros(y.shape, dtype=a.dtype).view(-1, y.shape[-1])
            lora_kernel(x, a, bt, mask, self.parts[site], delta)
            return y + delta.to(y.dtype).view(y.shape)
        if y.dtype == a.dtype:  # the add rides in the expand GEMMs
            return lora_dense(x, a, bt, mask, self.parts[site],
                              y.reshape(-1, y.shape[-1])).view(y.shape)
        delta = lora_dense(x, a, bt, mask, self.parts[site])
        return y + delta.to(y.dtype).view(y.shape)


class SlotWriter(Protocol):
    """What fills the slots: :class:`LoRASlots`, or under tensor parallelism rank 0's
    wrapper that has every rank make the same copy."""

    @property
    def num_slots(self) -> int: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def load(self, slot: int, adapter: LoRAAdapter) -> None: ...

    def clear(self, slot: int) -> None: ...


class LoRASlots:
    """Every layer's :class:`LayerLoRA` for one model, and the copies in and out of slots.
    ``cfg`` is the model as this rank holds it; ``shard`` cuts an adapter read whole into
    this rank's part (tensor parallelism: ``ShardPlan.shard_lora``)."""

    def __init__(self, cfg: ModelConfig, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device | None = None,
                 shard: Callable[[LoRAAdapter], LoRAAdapter] | None = None,
                 kernel: bool = False) -> None:
        self.shard = shard
        # the fused CPU op (torch.ops.hpu_serve.lora_add_) on fp32 / bf16 slots
        self.kernel = kernel and dtype in (torch.float32, torch.bfloat16)
        self.num_slots = max_loras
        self.max_rank = max_rank
        self.dtype = dtype
        shapes = site_shapes(cfg)
        self.layers = [
            LayerLoRA({site: shape for site, shape in shapes.items()
                       if i in site_layers(cfg, site)},
                      max_loras, max_rank, dtype, device, self.kernel)
            for i in range(cfg.num_layers)]

    def mask(self, slots: torch.Tensor) -> torch.Tensor:
        """What every layer's op reads this step, from each row's slot (0: none): the
        one-hot mask of the PyTorch op, or the kernel's slot index per row (-1: none)."""
        if self.kernel:
            return kernel_rows(slots)
        return slot_mask(slots, self.num_slots, self.dtype)

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Copies ``adapter`` (whole, as read) into ``slot`` (1..S) in place; the rest of
        the slot is zeroed (a site or rank row the adapter lacks adds nothing)."""
        assert 1 <= slot <= self.num_slots, slot
        self.clear(slot)
        if self.shard is not None:
            adapter = self.shard(adapter)
        rank = adapter.rank
        for (layer, site), (a, bt) in adapter.weights.items():
            a_slot, bt_slot = self.layers[layer].stacks(site)
            a_slot[:, slot - 1, :rank].copy_(a.view(a_slot.shape[0], rank, a.shape[1]))
            bt_slot[slot - 1, :rank].copy_(bt)

    def clear(self, slot: int) -> None:
        for layer in self.layers:
            for site in layer.sites:
                a, bt = layer.stacks(site)
                a[:, slot - 1].zero_()
                bt[slot - 1].zero_()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers
                   for t in layer.buffers())
