"""Scheduled sequences -> padded device tensors, laid out for static shapes.

A prefill batch is a right-padded ``[bs, q]`` grid with a flat ``slot_mapping`` into the
cache (pad tokens write into the reserved padding block, never a negative index); a decode
batch is one token per row plus either the flat list of all the batch's KV blocks with a
one-hot ``block_mapping`` (vLLM Gaudi's flat paged attention, any device) or per-row block
tables (the fused CPU kernel). Both can be padded further (``pad_to``) to a bucket's shape
without changing any code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from server.engine.core.sequence import Sequence
from server.engine.multimodal.mrope import mrope_positions
from server.engine.sampling_params import SamplingParams
from server.hpu.attention import AttentionMetadata
from server.hpu.graph_runner import ForwardInputs
from server.hpu.state_cache import StateInputs
from server.hpu.types import Bucket, DecodeLayout, Phase

# Additive mask value for unused slots of a block (finite: -inf - -inf would be NaN).
_MASKED = -1e30


@dataclass(slots=True)
class InputBuilder:
    """Builds :class:`ForwardInputs` for one KV cache geometry and layer-ops layout."""

    block_size: int
    pad_block_id: int
    device: torch.device
    dtype: torch.dtype  # the model's: the one-hot block mapping is multiplied in it
    # warmup's stand-in positions stay below it: the RoPE tables end there, and a bucket's
    # context + query width can exceed it (it is rounded up on both axes)
    max_model_len: int
    # whichever the model's layer ops read
    decode_layout: DecodeLayout = DecodeLayout.FLAT
    # hybrid models: the state cache's padding slot (pad rows and warmup's stand-ins use
    # it); None: the model keeps no state
    pad_state_slot: int | None = None
    # M-RoPE models (Qwen2.5-VL): positions go to the model as [3, bs, q] (temporal,
    # height, width; an image's tokens by its grid), in every step and warmup shape alike
    mrope: bool = False

    def _rope_positions(self, seqs: list[Sequence], positions: torch.Tensor) -> torch.Tensor:
        """Token indices ``[rows, q]`` (row i: ``seqs[i]``'s, the rest padding) as the
        model's rotary embedding takes them."""
        if not self.mrope:
            return positions
        out = positions.unsqueeze(0).repeat(3, 1, 1)
        for row, seq in enumerate(seqs):
            if seq.images:
                out[:, row] = mrope_positions(seq.images, positions[row])
        return out

    def _state(self, seqs: list[Sequence], bs: int, lens: list[int], continues: list[bool]
               ) -> StateInputs | None:
        """Each row's state slot, real tokens and whether it continues a state; pad rows
        take the padding slot with no tokens."""
        if self.pad_state_slot is None:
            return None
        pad = bs - len(seqs)
        slots = [self.pad_state_slot if s.state_slot is None else s.state_slot for s in seqs]
        dev = self.device
        return StateInputs(
            torch.tensor(slots + [self.pad_state_slot] * pad, device=dev),
            torch.tensor(list(lens) + [0] * pad, device=dev),
            torch.tensor(list(continues) + [False] * pad, device=dev))

    def prefill(
        self, seqs: list[Sequence], pad_to: tuple[int, int] | None = None,
        new_tokens: list[int] | None = None, ctx_blocks: int | None = None,
    ) -> ForwardInputs:
        """Each sequence's next ``new_tokens`` (default: all) past the tokens already in
        the cache (a cached prefix, earlier chunks), right-padded into ``[bs, q]``; the
        queries start there and attend to what precedes them in the cache. ``ctx_blocks``:
        the bucket's context width (static shapes: the tables are padded to it and whether
        the context path runs is the bucket's, not the data's, decision)."""
        starts = [s.num_computed_tokens for s in seqs]
        lens = (new_tokens if new_tokens is not None
                else [s.num_tokens - c for s, c in zip(seqs, starts)])
        bs, q = pad_to if pad_to is not None else (len(seqs), max(lens))
        block = self.block_size
        if ctx_blocks is None:
            width = max([-(-(c + q) // block) for c in starts] + [1])
            with_context = any(starts)
        else:
            width = ctx_blocks + -(-q // block)
            with_context = ctx_blocks > 0
        token_ids = torch.zeros(bs, q, dtype=torch.long)
        block_tables = torch.full((bs, width), self.pad_block_id, dtype=torch.long)
        for row, seq in enumerate(seqs):
            start = starts[row]
            token_ids[row, : lens[row]] = torch.tensor(
                seq.all_token_ids[start : start + lens[row]])
            # a chunked prompt holds blocks for all of it: only those up to the chunk count
            table = seq.block_table[:width]
            block_tables[row, : len(table)] = torch.tensor(table)
        seq_lens = torch.zeros(bs, dtype=torch.long)  # new tokens per row
        seq_lens[: len(seqs)] = torch.tensor(lens)
        context = torch.zeros(bs, dtype=torch.long)  # cached tokens per row
        context[: len(seqs)] = torch.tensor(starts)
        offsets = torch.arange(q).expand(bs, q)
        positions = offsets + context.unsqueeze(1)
        is_real = offsets < seq_lens.unsqueeze(1)
        slots = block_tables.gather(1, positions // block) * block + positions % block
        pad_slots = self.pad_block_id * block + offsets % block
        slot_mapping = torch.where(is_real, slots, pad_slots).reshape(-1)
        # Pad rows point at token 0: their logits are computed (static shape) and dropped.
        logits_indices = (torch.arange(bs) * q + seq_lens - 1).clamp(min=0)
        meta = AttentionMetadata(True, block, slot_mapping.to(self.device))
        total = (context + seq_lens).clamp(min=1)
        if self.decode_layout is DecodeLayout.BLOCK_TABLES:
            # Every token is a row of the paged-attention kernel: its sequence's table and
            # the keys up to itself (causal, cached prefix included); pad tokens see their
            # row's real keys.
            meta.block_tables = block_tables.to(torch.int32).repeat_interleave(q, dim=0).to(
                self.device)
            token_lens = torch.minimum(positions + 1, total.unsqueeze(1))
            meta.seq_lens = token_lens.reshape(-1).to(torch.int32).to(self.device)
        if with_context:
            # the queries attend to the cache (prefix and their own fresh keys)
            meta.has_context = True
            meta.context_tables = block_tables.to(self.device)
            meta.context_lens = context.to(self.device)
            meta.total_lens = total.to(self.device)
        return ForwardInputs(
            token_ids.to(self.device),
            self._rope_positions(seqs, torch.where(is_real, positions, 0)).to(self.device),
            meta,
            logits_indices.to(self.device),
            len(seqs),
            state=self._state(seqs, bs, lens, [c > 0 for c in starts]),
        )

    def verify(self, seqs: list[Sequence], drafts: list[list[int]],
               pad_to: tuple[int, int, int]) -> ForwardInputs:
        """A speculative verify step in the flat decode layout: each row's last token and
        its drafts, ``q`` query tokens per row (rows with fewer drafts padded: their pad
        queries write the padding block and look from the row's last real position), over
        the batch's blocks padded to ``blocks``. Logits of every query token come back,
        row-major."""
        bs, q, num_blocks = pad_to
        block = self.block_size
        token_ids = torch.zeros(bs, q, dtype=torch.long)
        positions = torch.zeros(bs, q, dtype=torch.long)
        slots = torch.tensor([self.pad_block_id * block + t % block for t in range(q)]
                             ).repeat(bs, 1)
        block_list: list[int] = []
        groups: list[int] = []
        starts: list[int] = []
        last_query: list[int] = []  # each block's row's last real query offset
        for row, (seq, extra) in enumerate(zip(seqs, drafts)):
            first = seq.num_tokens - 1
            n = 1 + len(extra)
            token_ids[row, :n] = torch.tensor([seq.last_token_id] + extra)
            pos = torch.arange(first, first + n)
            positions[row, :n] = pos
            positions[row, n:] = first + n - 1
            table = torch.tensor(seq.block_table)
            slots[row, :n] = table[pos // block] * block + pos % block
            block_list += seq.block_table
            groups += [row] * len(seq.block_table)
            starts += range(-first, len(seq.block_table) * block - first, block)
            last_query += [n - 1] * len(seq.block_table)
        pad_blocks = num_blocks - len(block_list)
        block_list_t = torch.tensor(block_list + [self.pad_block_id] * pad_blocks)
        groups_t = torch.tensor(groups + [bs] * pad_blocks)
        starts_t = torch.tensor(starts + [0] * pad_blocks)
        # key offset (from the row's first query) <= the query's own offset, pad queries
        # clamped to the row's last real one; pad blocks keep slot 0 visible (finite)
        key_off = starts_t.view(-1, 1, 1) + torch.arange(block).view(1, 1, -1)
        query_off = torch.minimum(torch.arange(q).view(1, -1, 1),
                                  torch.tensor(last_query + [0] * pad_blocks).view(-1, 1, 1))
        visible = key_off <= query_off
        visible[len(block_list):] = False
        visible[len(block_list):, :, 0] = True
        block_bias = torch.where(visible, 0.0, _MASKED)
        mapping = torch.nn.functional.one_hot(groups_t, bs + 1)[:, :bs].to(self.dtype)
        dev = self.device
        meta = AttentionMetadata(
            False, block, slots.reshape(-1).to(dev),
            block_list=block_list_t.to(dev), block_groups=groups_t.to(dev),
            block_mapping=mapping.to(dev), block_bias=block_bias.to(dev),
            block_start=starts_t.to(dev))
        return ForwardInputs(token_ids.to(dev), self._rope_positions(seqs, positions).to(dev),
                             meta, torch.arange(bs * q).to(dev), len(seqs))

    def packed(self, seqs: list[Sequence], new_tokens: list[int],
               drafts: list[list[int]] | None = None) -> ForwardInputs:
        """Each sequence's next ``new_tokens`` past its cached ones, packed back to back in
        one ``[1, T]`` row (eager CPU with per-row block tables): no padding, and decode
        rows (one new token) ride in the same forward as prompt chunks. Every token is a
        row of the paged-attention kernel with its sequence's table and the keys up to
        itself. ``drafts``: a verify step (each row's last token then its drafts, every
        token's logits returned)."""
        block = self.block_size
        starts = [s.num_computed_tokens for s in seqs]
        ids: list[int] = []
        if drafts is not None:
            starts = [s.num_tokens - 1 for s in seqs]
            for seq, extra in zip(seqs, drafts):
                ids += [seq.last_token_id] + extra
        for seq, start, n in zip(seqs, starts, new_tokens if drafts is None else []):
            ids += seq.all_token_ids[start : start + n]
        width = max(-(-(c + n) // block) for c, n in zip(starts, new_tokens))
        tables = torch.full((len(seqs), width), self.pad_block_id, dtype=torch.int32)
        for row, seq in enumerate(seqs):
            table = seq.block_table[:width]
            tables[row, : len(table)] = torch.tensor(table, dtype=torch.int32)
        lens = torch.tensor(new_tokens)
        owner = torch.repeat_interleave(torch.arange(len(seqs)), lens)
        first = torch.cumsum(lens, 0) - lens  # each sequence's first token in the row
        positions = torch.arange(len(ids)) - first[owner] + torch.tensor(starts)[owner]
        token_tables = tables[owner]
        slots = (token_tables.gather(1, (positions // block).unsqueeze(1)).squeeze(1).long()
                 * block + positions % block)
        dev = self.device
        meta = AttentionMetadata(True, block, slots.to(dev),
                                 block_tables=token_tables.to(dev),
                                 seq_lens=(positions + 1).to(torch.int32).to(dev),
                                 has_context=any(starts), packed=len(seqs) > 1)
        logits_at = (torch.cumsum(lens, 0) - 1) if drafts is None else torch.arange(len(ids))
        rope_positions = positions.view(1, -1)
        if self.mrope:  # each sequence's stretch of the packed row
            rope_positions = positions.unsqueeze(0).repeat(3, 1)
            for seq, at, n in zip(seqs, first.tolist(), lens.tolist()):
                if seq.images:
                    rope_positions[:, at:at + n] = mrope_positions(seq.images,
                                                                   positions[at:at + n])
            rope_positions = rope_positions.view(3, 1, -1)
        return ForwardInputs(
            torch.tensor(ids).view(1, -1).to(dev),
            rope_positions.to(dev),
            meta,
            logits_at.to(dev),
            len(seqs),
        )

    def decode(
        self, seqs: list[Sequence], pad_to: tuple[int, int] | None = None
    ) -> ForwardInputs:
        """Each sequence's last token; its KV blocks flattened into one block list."""
        if self.decode_layout is DecodeLayout.BLOCK_TABLES:
            assert pad_to is None or pad_to[0] == len(seqs), "block tables are never padded"
            return self._decode_tables(seqs)
        block = self.block_size
        positions = [s.num_tokens - 1 for s in seqs]
        block_list = [b for s in seqs for b in s.block_table]
        groups = [row for row, s in enumerate(seqs) for _ in s.block_table]
        usage = []
        starts = []  # each block's first position relative to its row's query (windows)
        for seq, pos in zip(seqs, positions):
            usage += [block] * (len(seq.block_table) - 1) + [pos % block + 1]
            starts += range(-pos, len(seq.block_table) * block - pos, block)
        bs, num_blocks = pad_to if pad_to is not None else (len(seqs), len(block_list))
        pad_rows = bs - len(seqs)
        pad_blocks = num_blocks - len(block_list)

        token_ids = torch.tensor([s.last_token_id for s in seqs] + [0] * pad_rows)
        pos_t = torch.tensor(positions + [0] * pad_rows)
        slots = [s.block_table[p // block] * block + p % block for s, p in zip(seqs, positions)]
        slots += [self.pad_block_id * block + i % block for i in range(pad_rows)]
        block_list_t = torch.tensor(block_list + [self.pad_block_id] * pad_blocks)
        groups_t = torch.tensor(groups + [bs] * pad_blocks)
        usage_t = torch.tensor(usage + [1] * pad_blocks)
        starts_t = torch.tensor(starts + [0] * pad_blocks)
        block_bias = torch.where(
            torch.arange(block).unsqueeze(0) < usage_t.unsqueeze(1), 0.0, _MASKED
        )
        # One-hot rows; pad blocks map to the extra column bs, which is then dropped.
        mapping = torch.nn.functional.one_hot(groups_t, bs + 1)[:, :bs].to(self.dtype)
        dev = self.device
        meta = AttentionMetadata(
            False,
            block,
            torch.tensor(slots).to(dev),
            block_list=block_list_t.to(dev),
            block_groups=groups_t.to(dev),
            block_mapping=mapping.to(dev),
            block_bias=block_bias.to(dev),
            block_start=starts_t.to(dev),
        )
        return ForwardInputs(
            token_ids.view(bs, 1).to(dev),
            self._rope_positions(seqs, pos_t.view(bs, 1)).to(dev),
            meta,
            torch.arange(bs).to(dev),
            len(seqs),
            state=self._state(seqs, bs, [1] * len(seqs), [True] * len(seqs)),
        )

    def _decode_tables(self, seqs: list[Sequence]) -> ForwardInputs:
        """Each sequence's last token with its own block table; nothing padded (eager CPU)."""
        block = self.block_size
        bs = len(seqs)
        width = max(len(s.block_table) for s in seqs)
        tables = [s.block_table + [self.pad_block_id] * (width - len(s.block_table))
                  for s in seqs]
        lens = [s.num_tokens for s in seqs]
        slots = [s.block_table[(n - 1) // block] * block + (n - 1) % block
                 for s, n in zip(seqs, lens)]
        dev = self.device
        meta = AttentionMetadata(
            False, block, torch.tensor(slots, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
        )
        return ForwardInputs(
            torch.tensor([s.last_token_id for s in seqs], device=dev).view(bs, 1),
            self._rope_positions(seqs, torch.tensor([n - 1 for n in lens]).view(bs, 1)).to(dev),
            meta,
            torch.arange(bs, device=dev),
            bs,
            state=self._state(seqs, bs, [1] * bs, [True] * bs),
        )

    # warmup: shapes without requests

    def dummy(self, phase: Phase, bucket: Bucket) -> ForwardInputs:
        """Inputs of exactly a bucket's shape, every write landing in the padding block."""
        bs, q, blocks = bucket
        block = self.block_size
        pad = self.pad_block_id
        if phase is Phase.PREFILL:
            # tokens the queries follow in the cache; the tables keep the bucket's full
            # width whatever the context length (ctx_blocks below)
            context = max(0, min(blocks * block, self.max_model_len - q))
            seqs = [dummy_seq(context + q, [pad] * (blocks + -(-q // block)))
                    for _ in range(bs)]
            for seq in seqs:
                seq.num_computed_tokens = context
            return self.prefill(seqs, pad_to=(bs, q), ctx_blocks=blocks)
        # Spread the bucket's blocks over its rows; every row has at least one.
        per_row = [blocks // bs + (1 if i < blocks % bs else 0) for i in range(bs)]
        if q > 1:  # a verify bucket: each row's drafts fill the end of its last block
            seqs = [dummy_seq(max(n * block - q + 1, 1), [pad] * n) for n in per_row if n > 0]
            return self.verify(seqs, [[0] * min(q - 1, n * block - 1) for n in per_row if n],
                               (bs, q, blocks))
        seqs = [dummy_seq(n * block, [pad] * n) for n in per_row if n > 0]
        return self.decode(seqs, pad_to=(bs, blocks))


def dummy_seq(num_tokens: int, block_table: list[int],
              params: SamplingParams | None = None) -> Sequence:
    """A stand-in sequence for shapes without requests (warmup): with the padding block in
    its table, everything it writes lands there."""
    seq = Sequence(-1, "warmup", 0, [0] * num_tokens, params or SamplingParams(), 0.0)
    seq.block_table = block_table
    return seq
