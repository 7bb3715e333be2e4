"""EAGLE / EAGLE-3 heads as the draft of speculative decoding (``method: eagle | eagle3``),
and DeepSeek's MTP layer the same way (``method: mtp``, server/models/mtp.py).

The head drafts from the target's hidden states, so the target's forward leaves them where
the head finds them: a *feature store* with one row per KV-cache slot. The target's graphs
write each token's feature (server/models/eagle.py: its final hidden state, or EAGLE-3's
``fc`` over three layers' streams) into the row of the token's slot, as they write its K/V.
The head's input at position ``p`` is then the row of position ``p - 1``'s slot: a gather
by slot numbers computed with the step's inputs, whatever the layout (prompt chunks,
prefix-cache hits, packed rows, verify rows), with nothing to keep per sequence: rows live
and die with their blocks (preemption, aborts and prefix caching need nothing more), and
a prefix-cache hit finds the feature before its first new token in the cached block.

The head runs through :class:`~server.engine.worker.draft_model.DraftModel` like a draft
model: it mirrors every target step on its own graphs (the same bucket; its one layer's
K/V of those tokens, hidden inputs from the target's features) and proposes with decode
steps of its own. A proposing step writes the head's output into the row of its token's
slot (the target has not computed that position yet; its verify step overwrites the row),
which is the next draft step's hidden input; a mirrored step writes its outputs to a
scratch row. Position 0 reads a row of zeros.
"""

from __future__ import annotations

import dataclasses

import torch

from server.engine.core.sequence import Sequence
from server.hpu.graph_runner import ForwardInputs
from server.hpu.kv_cache import KVCache
from server.hpu.layer_ops import TorchLayerOps
from server.models.eagle import EagleHead
from server.models.mtp import DeepSeekMTP

# what drafts on the feature store: an EAGLE / EAGLE-3 head, or DeepSeek's MTP layer
DraftHead = EagleHead | DeepSeekMTP


class FeatureStore:
    """``[slots + 2, H]``: one row per KV slot (the padding block's included), then a row
    of zeros (what position 0 reads) and a scratch row (what mirrored steps write)."""

    def __init__(self, num_blocks: int, block_size: int, hidden: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        slots = (num_blocks + 1) * block_size
        self.block_size = block_size
        self.zero_row = slots
        self.scratch_row = slots + 1
        self.rows = torch.zeros(slots + 2, hidden, dtype=dtype, device=device)

    @staticmethod
    def bytes_per_block(block_size: int, hidden: int, dtype: torch.dtype) -> int:
        return block_size * hidden * torch.empty((), dtype=dtype).element_size()

    @property
    def nbytes(self) -> int:
        return self.rows.numel() * self.rows.element_size()

    def slot_before(self, seq: Sequence, position: int) -> int:
        """The row of the token before ``position`` (position 0: the zero row)."""
        if position == 0:
            return self.zero_row
        p = position - 1
        return seq.block_table[p // self.block_size] * self.block_size + p % self.block_size


class FeatureTap:
    """Inside the target's forward: stores each token's feature at its slot, and passes on
    the final hidden state (an EAGLE-3 target's output carries the three streams after it)."""

    def __init__(self, head: DraftHead, store: FeatureStore) -> None:
        self.head = head
        self.store = store

    def __call__(self, hidden: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
        flat = hidden.reshape(-1, hidden.shape[-1])
        rows = self.store.rows
        rows.index_copy_(0, slot_mapping, self.head.features(flat).to(rows.dtype))
        return hidden[..., :self.head.config.hidden_size]


class EagleForward:
    """The head's graphs' function: padded inputs (with ``spec_slots``) -> float32 logits
    over the draft vocabulary of each row's last token; the head's K/V and output rows are
    written in place."""

    def __init__(self, head: DraftHead, kv_caches: list[KVCache], store: FeatureStore) -> None:
        self.head = head
        self.kv_caches = kv_caches
        self.store = store

    def __call__(self, inputs: ForwardInputs) -> torch.Tensor:
        assert inputs.spec_slots is not None
        rows = self.store.rows
        hidden = rows.index_select(0, inputs.spec_slots[0])
        out = self.head(inputs.input_ids, inputs.positions, hidden, self.kv_caches,
                        inputs.meta)
        rows.index_copy_(0, inputs.spec_slots[1], out.to(rows.dtype))
        return self.head.compute_logits(out.index_select(0, inputs.logits_indices))


class HeadInputs:
    """Adds the feature-store rows to the inputs of the head's steps (the seam
    :class:`DraftModel` calls: mirrored, proposing, warming)."""

    def __init__(self, store: FeatureStore) -> None:
        self.store = store

    def mirrored(self, inputs: ForwardInputs, seqs: list[Sequence], starts: list[int]
                 ) -> ForwardInputs:
        """A target step's inputs: each row's tokens from its first computed one, the row's
        first token at flat index ``starts[row]``."""
        firsts = [self.store.slot_before(s, s.num_computed_tokens) for s in seqs]
        return self._with(inputs, starts, firsts, propose=False)

    def proposing(self, inputs: ForwardInputs, standins: list[Sequence]) -> ForwardInputs:
        """A draft decode step: each row's one token at its last position."""
        firsts = [self.store.slot_before(s, s.num_tokens - 1) for s in standins]
        return self._with(inputs, list(range(len(standins))), firsts, propose=True)

    def warming(self, inputs: ForwardInputs) -> ForwardInputs:
        """Warmup: reads the zero row, writes the scratch row."""
        n = inputs.meta.slot_mapping.numel()
        device = inputs.meta.slot_mapping.device
        return _replace_slots(inputs, torch.stack([
            torch.full((n,), self.store.zero_row, dtype=torch.long, device=device),
            torch.full((n,), self.store.scratch_row, dtype=torch.long, device=device)]))

    def _with(self, inputs: ForwardInputs, starts: list[int], firsts: list[int],
              propose: bool) -> ForwardInputs:
        slots = inputs.meta.slot_mapping.long()
        device = slots.device
        # every token reads its predecessor in the row, the row's first one the slot
        # before its position (padding tokens read whatever row: never used)
        prev = torch.roll(slots, 1)
        prev[torch.tensor(starts, dtype=torch.long, device=device)] = torch.tensor(
            firsts, dtype=torch.long, device=device)
        out = slots if propose else torch.full_like(slots, self.store.scratch_row)
        return _replace_slots(inputs, torch.stack([prev, out]))


def _replace_slots(inputs: ForwardInputs, spec_slots: torch.Tensor) -> ForwardInputs:
    return dataclasses.replace(inputs, spec_slots=spec_slots)


def prepare_head(head: DraftHead, target_model: torch.nn.Module, ops: TorchLayerOps) -> None:
    """The head runs the target's layer ops (one input layout for both) and the target's
    embeddings and LM head where it shares them, as the platform prepared them (packed
    linears); an EAGLE-3 target also returns the streams its head reads."""
    head.share_with(target_model)  # type: ignore[arg-type]
    head.use_ops(ops)
    if head.aux_layers:
        target_model.emit_aux_hidden(head.aux_layers)  # type: ignore[operator]


def head_kv_bytes_per_block(head: DraftHead, block_size: int, dtype: torch.dtype,
                            model_dtype: torch.dtype) -> int:
    """What one block costs the head: its layer's K/V and the feature rows."""
    return (head.config.kv_layout.bytes_per_block(block_size, dtype)
            + FeatureStore.bytes_per_block(block_size, head.hidden_size, model_dtype))
