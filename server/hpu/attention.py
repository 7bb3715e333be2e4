"""Paged attention written with static-shape PyTorch ops only.

Every tensor's shape depends on the padded batch shape alone (``[bs, q]`` for prefill,
``(bs, num_blocks)`` for decode), never on the data, so one compiled/captured graph per
bucket covers every batch padded to it. Decode is the "flat paged attention" of vLLM's Gaudi
backend: the blocks of all sequences form one flat list, a one-hot ``block_mapping`` matrix
turns per-sequence reductions into dense matmuls.

Cache layout, per layer: K and V are ``[num_blocks + 1, Hkv, block_size, D]``. Head-major
blocks make a gathered block a ready ``[Hkv, B, D]`` matmul operand (a token-major layout
costs a transposing copy of every gathered block, per layer, per step), and a block is one
contiguous row, so gathering is a plain 2-D row gather.

Sliding windows (``window``, per layer) follow transformers' rule: the query at position p
sees keys at positions k with ``p - window < k <= p``, ``window`` keys itself included. They
are masks over the same static shapes: nothing is skipped, so a windowed layer costs what a
global one does (plus the mask), and the layers without a window build no mask at all.

Attention sinks (``sinks``, gpt-oss): one learned logit per query head that joins every
softmax's denominator and contributes no value, so a query may attend to "nothing". Every
path takes them as an optional ``[Hq]`` float tensor (None: no sink): the dense paths add
the sink as one extra score column and drop it after the softmax, the flat decode paths
start each row's running max at the sink and add ``exp(sink - max)`` to its sum.

Chunked local attention (``chunk``, per layer: Llama 4's RoPE layers) splits positions into
chunks of ``chunk`` tokens: the query at position p sees keys at positions k with
``k // chunk == p // chunk`` and ``k <= p``. It combines with a window the same way (both
masks apply), over the same static shapes.

Bidirectional image tokens (``image_ends``, Gemma 3's prefills): a query inside an image
also sees the image's later tokens, as transformers' ``token_type_ids`` mask lets it. Each
query carries the (exclusive) end position of its image, 0 for a text token, and sees key k
where the causal (windowed) rule allows it or where ``p < k < end``. A window still bounds
what lies before the query, never the image's own later tokens (transformers' rule for
sliding layers: the window and, within it, causal or same-image). The scheduler keeps an
image's tokens in one prefill chunk, so every key such a query sees is in the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Additive mask value of a slot out of a window (finite, like the block bias's: -inf - -inf
# would be NaN where a whole block is masked)
_MASKED = -1e30


@dataclass(slots=True)
class AttentionMetadata:
    """Device tensors describing where a padded batch's K/V live.

    A slot is ``block * block_size + offset``; block ``num_blocks`` is the padding block that
    pad tokens write into and pad entries read from (no negative indices).
    """

    is_prompt: bool
    block_size: int
    # [bs * q] cache slot of every input token (prefill) or [bs] (decode); pads -> pad block
    slot_mapping: torch.Tensor
    # the same slots split into (block, offset) once per step rather than once per layer
    slot_block: torch.Tensor | None = None
    slot_offset: torch.Tensor | None = None
    # decode only, N = padded number of blocks of the whole batch:
    block_list: torch.Tensor | None = None  # [N] physical block ids, pad = pad block
    block_groups: torch.Tensor | None = None  # [N] owning row in the batch, pad = bs
    block_mapping: torch.Tensor | None = None  # [N, bs] one-hot of block_groups, model dtype
    block_bias: torch.Tensor | None = None  # [N, block_size] 0 for valid slots, -inf-ish else
    # [N] position of the block's first slot minus its row's query position (<= 0; pad 0):
    # what sliding windows mask by
    block_start: torch.Tensor | None = None
    # decode with per-row tables instead (the fused CPU kernel reads blocks in place):
    block_tables: torch.Tensor | None = None  # [bs, max blocks] int32 physical block ids
    seq_lens: torch.Tensor | None = None  # [bs] int32 tokens per row, the new one included
    # prefill after a cached prefix (prefix caching), read from the cache:
    has_context: bool = False  # some row starts after a cached prefix
    context_tables: torch.Tensor | None = None  # [bs, blocks] long: each row's whole table
    context_lens: torch.Tensor | None = None  # [bs] cached tokens before the row's queries
    total_lens: torch.Tensor | None = None  # [bs] cached + new tokens
    # several sequences packed back to back in one row of tokens (eager CPU, no padding):
    # each token is a row of the paged kernel, nothing else can attend over them
    packed: bool = False
    # prefill of a model whose image tokens attend to each other both ways (Gemma 3):
    # [bs * q] the end position (exclusive) of each query's image, 0 for text tokens
    image_ends: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.slot_block is None:
            self.slot_block = torch.div(self.slot_mapping, self.block_size, rounding_mode="floor")
        if self.slot_offset is None:
            self.slot_offset = self.slot_mapping % self.block_size


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    meta: AttentionMetadata,
) -> None:
    """Scatter new K/V (``[T, Hkv, D]``) into their cache slots, one op per tensor."""
    index = (meta.slot_block, slice(None), meta.slot_offset)
    k_cache[index] = key.to(k_cache.dtype)  # a no-op unless the cache is stored in fp8
    v_cache[index] = value.to(v_cache.dtype)


def window_visible(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int | None,
                   chunk: int | None = None) -> torch.Tensor:
    """Causal (and windowed, and chunked) visibility of keys by queries, broadcasting the
    two position tensors against each other: ``p - window < k <= p``, and ``k`` in ``p``'s
    chunk."""
    distance = query_pos - key_pos
    visible = distance >= 0
    if window is not None:
        visible = visible & (distance < window)
    if chunk is not None:
        visible = visible & (torch.div(query_pos, chunk, rounding_mode="floor")
                             == torch.div(key_pos, chunk, rounding_mode="floor"))
    return visible


def _image_visible(visible: torch.Tensor, query_pos: torch.Tensor, key_pos: torch.Tensor,
                   image_ends: torch.Tensor | None) -> torch.Tensor:
    """``visible`` widened by each image query's view of its image's later tokens
    (``query_pos < key_pos < image_end``); the position tensors broadcast as there."""
    if image_ends is None:
        return visible
    return visible | ((key_pos > query_pos) & (key_pos < image_ends))


def _chunk_masked(distance: torch.Tensor, query_pos: torch.Tensor, chunk: int) -> torch.Tensor:
    """Where a key at ``distance`` (key - query position, <= 0 where visible) from a query at
    ``query_pos`` lies before the query's chunk: ``distance < -(query_pos % chunk)``."""
    return distance < -torch.remainder(query_pos, chunk)


def _block_query_pos(meta: AttentionMetadata, bs: int) -> torch.Tensor:
    """[N] the (first) query position of each block's row: every row lists all its blocks,
    and its block 0 starts at position 0, so the position is the largest ``-block_start``
    of the row's blocks (pad blocks: row ``bs``, position 0). Shapes are the batch's."""
    assert meta.block_start is not None and meta.block_groups is not None
    pos = torch.zeros(bs + 1, dtype=meta.block_start.dtype, device=meta.block_start.device)
    pos = pos.scatter_reduce(0, meta.block_groups, -meta.block_start, reduce="amax",
                             include_self=True)
    return pos.index_select(0, meta.block_groups)


def prompt_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
    softcap: float | None = None, window: int | None = None, chunk: int | None = None,
    sinks: torch.Tensor | None = None, image_ends: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention over a right-padded ``[bs, q]`` batch with no prior context.

    query ``[bs, q, Hq, D]``, key/value ``[bs, q, Hkv, D]`` -> ``[bs, q, Hq, D]``. A causal
    mask alone is enough: real tokens sit left of the padding and so never see it; pad rows
    compute finite garbage that nobody reads. Every row starts at position 0, so one
    ``[q, q]`` mask serves the batch when a window applies; ``image_ends`` ``[bs, q]``
    (bidirectional image tokens) make it one ``[q, q]`` mask per row.
    """
    q = query.transpose(1, 2)
    k = key.transpose(1, 2)
    v = value.transpose(1, 2)
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    q_len = q.shape[2]
    mask = None
    # else the window (chunk) covers every prompt here
    window = window if window is not None and window < q_len else None
    chunk = chunk if chunk is not None and chunk < q_len else None
    if window is not None or chunk is not None or image_ends is not None:
        pos = torch.arange(q_len, device=q.device)
        mask = window_visible(pos.view(-1, 1), pos.view(1, -1), window, chunk)
        if image_ends is not None:  # [bs, 1, q, q]: each row's images
            mask = _image_visible(mask, pos.view(-1, 1), pos.view(1, -1),
                                  image_ends.view(-1, 1, q_len, 1))
    if softcap is None and sinks is None:
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        else:
            # additive in the model dtype: 1.2x faster than a boolean mask on CPU (1,024
            # tokens, 16 heads); every row sees at least its own token, so none is all -inf
            bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device)
            bias = bias.masked_fill(~mask, float("-inf"))
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
        return out.transpose(1, 2)
    # Gemma 2's soft-capped scores, cap * tanh(s / cap), and sinks: no fused kernel takes them
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        mask = torch.ones(q_len, q_len, dtype=torch.bool, device=scores.device).tril()
    probs = _softmax_with_sinks(scores.masked_fill(~mask, float("-inf")), sinks)
    return torch.matmul(probs.to(v.dtype), v).transpose(1, 2)


def _softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dim of float32 ``scores [bs, Hq, q, L]`` (masked slots -inf),
    each head's sink logit joining the denominator (an extra column, dropped after)."""
    if sinks is None:
        return scores.softmax(dim=-1)
    sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    return torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]


def paged_prefill_attention(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    meta: AttentionMetadata, scale: float, softcap: float | None = None,
    window: int | None = None, chunk: int | None = None, sinks: torch.Tensor | None = None,
    image_ends: torch.Tensor | None = None,
) -> torch.Tensor:
    """Prefill queries ``[bs, q, Hq, D]`` after a cached prefix: each row attends to its
    whole sequence in the cache (the prefix, and its own keys written just before), causally
    (and within ``window``) by absolute position. Each sequence's blocks are gathered once
    and shared by all its queries."""
    assert meta.context_tables is not None and meta.context_lens is not None
    assert meta.total_lens is not None
    bs, q_len, num_q_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[1]
    groups = num_q_heads // num_kv_heads
    tables = meta.context_tables
    keys = k_cache.index_select(0, tables.reshape(-1)).view(
        bs, tables.shape[1], num_kv_heads, meta.block_size, head_dim)
    # [bs, Hkv, L, D], L = blocks * block_size, position-ordered
    keys = keys.permute(0, 2, 1, 3, 4).reshape(bs, num_kv_heads, -1, head_dim)
    keys = keys.to(query.dtype)
    values = keys if v_cache is k_cache else _prefill_values(v_cache, tables, bs, meta)
    values = values.to(query.dtype)
    if groups > 1 and num_kv_heads == 1:
        # one KV head (multi-query; MLA's latent): every query head reads it through a
        # stride-0 view instead of Hq copies of the whole context
        keys = keys.expand(-1, num_q_heads, -1, -1)
        values = values.expand(-1, num_q_heads, -1, -1)
    elif groups > 1:
        keys = keys.repeat_interleave(groups, dim=1)
        values = values.repeat_interleave(groups, dim=1)
    q = query.transpose(1, 2)  # [bs, Hq, q, D]
    key_pos = torch.arange(keys.shape[2], device=query.device)
    query_pos = meta.context_lens.view(bs, 1) + torch.arange(q_len, device=query.device)
    # Pad queries (past a row's end) look from its last position: with a window they would
    # otherwise see no key at all, and the NaN of an empty softmax would reach the padding
    # block through their values, then every query that multiplies it by a zero weight.
    query_pos = torch.minimum(query_pos, meta.total_lens.view(bs, 1) - 1)
    visible = window_visible(query_pos.unsqueeze(-1), key_pos.view(1, 1, -1), window, chunk)
    if image_ends is not None:  # [bs, q]
        visible = _image_visible(visible, query_pos.unsqueeze(-1), key_pos.view(1, 1, -1),
                                 image_ends.view(bs, q_len, 1))
    visible = (visible & (key_pos.view(1, 1, -1) < meta.total_lens.view(bs, 1, 1))).unsqueeze(1)
    if softcap is None and sinks is None:
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible, scale=scale)
        return out.transpose(1, 2)
    scores = torch.matmul(q, keys.transpose(-1, -2)).float() * scale  # [bs, Hq, q, L]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    probs = _softmax_with_sinks(scores.masked_fill(~visible, float("-inf")), sinks)
    return torch.matmul(probs.to(values.dtype), values).transpose(1, 2)


def _prefill_values(v_cache: torch.Tensor, tables: torch.Tensor, bs: int,
                    meta: AttentionMetadata) -> torch.Tensor:
    """Each row's values ``[bs, Hkv, L, Dv]``, position-ordered."""
    num_kv_heads, value_dim = v_cache.shape[1], v_cache.shape[-1]
    values = v_cache.index_select(0, tables.reshape(-1)).view(
        bs, tables.shape[1], num_kv_heads, meta.block_size, value_dim)
    return values.permute(0, 2, 1, 3, 4).reshape(bs, num_kv_heads, -1, value_dim)


def _gather_blocks(k_cache: torch.Tensor, v_cache: torch.Tensor, block_list: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The listed blocks of K and V, ``[N, Hkv, B, D]`` / ``[N, Hkv, B, Dv]``, as 2-D row
    gathers (the N-D index_select takes a much slower element-wise path on CPU); one
    gather where a single tensor holds keys and values (multi-head latent attention)."""
    keys = k_cache.flatten(1).index_select(0, block_list).view(
        block_list.shape[0], *k_cache.shape[1:])
    if v_cache is k_cache:
        return keys, keys
    values = v_cache.flatten(1).index_select(0, block_list).view(
        block_list.shape[0], *v_cache.shape[1:])
    return keys, values


def flat_paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    softcap: float | None = None,
    window: int | None = None,
    chunk: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode token per row attending over its blocks. query ``[bs, Hq, D]`` -> ``[bs,
    Hq, Dv]`` (Dv, the values' size: D but in multi-head latent attention's reference path).

    Per-block partial softmax, then a cross-block renormalisation using the sequence-wide
    max (scatter amax by group) and sums via ``block_mapping`` matmuls. A ``window`` masks
    the slots that fell out of it (by ``block_start``); a block wholly out of it still
    takes part, so shapes stay those of the batch.
    """
    assert meta.block_list is not None and meta.block_mapping is not None
    assert meta.block_bias is not None and meta.block_groups is not None
    bs, num_q_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[1]
    groups = num_q_heads // num_kv_heads
    block_size = meta.block_size
    num_blocks = meta.block_list.shape[0]
    value_dim = v_cache.shape[-1]

    # batch2block: every block gets its sequence's query.
    q_blk = meta.block_mapping @ (query * scale).reshape(bs, num_q_heads * head_dim)
    q_blk = q_blk.view(num_blocks, num_kv_heads, groups, head_dim)

    keys, values = _gather_blocks(k_cache, v_cache, meta.block_list)
    if keys.dtype != query.dtype:  # fp8 storage: upcast the gathered blocks only
        keys = keys.to(query.dtype)
        values = keys if v_cache is k_cache else values.to(query.dtype)

    scores = torch.matmul(q_blk, keys.transpose(-1, -2)).float()  # [N, Hkv, G, B]
    if softcap is not None:  # Gemma 2
        scores = torch.tanh(scores / softcap) * softcap
    bias = meta.block_bias
    if window is not None:
        assert meta.block_start is not None
        # key position - query position of every slot: visible from -(window - 1) to 0
        distance = meta.block_start.view(-1, 1) + torch.arange(block_size, device=bias.device)
        bias = bias.masked_fill(distance <= -window, _MASKED)
    if chunk is not None:  # the slots before the query's chunk
        assert meta.block_start is not None
        distance = meta.block_start.view(-1, 1) + torch.arange(block_size, device=bias.device)
        bias = bias.masked_fill(
            _chunk_masked(distance, _block_query_pos(meta, bs).view(-1, 1), chunk), _MASKED)
    scores = scores + bias.view(num_blocks, 1, 1, block_size)
    block_max = scores.amax(dim=-1)  # [N, Hkv, G]

    # Sequence-wide max per (row, head): scatter amax into bs+1 rows (pad blocks -> row bs);
    # a row's sink (if any) is where its max starts.
    seq_max = _initial_max((bs + 1, num_kv_heads, groups), sinks, scores)
    index = meta.block_groups.view(-1, 1, 1).expand(-1, num_kv_heads, groups)
    seq_max = seq_max.scatter_reduce(0, index, block_max, reduce="amax", include_self=True)
    block_seq_max = seq_max.index_select(0, meta.block_groups)  # [N, Hkv, G]

    # Masked slots sit ~1e30 below the max; exp's underflow path for such inputs is ~5x
    # slower than its normal one, and exp(-80) ~ 1e-35 already weighs nothing in fp32.
    probs = torch.exp((scores - block_seq_max.unsqueeze(-1)).clamp_min_(-80.0))  # [N, Hkv, G, B]
    block_sum = probs.sum(dim=-1)  # [N, Hkv, G]
    out_blk = torch.matmul(probs.to(values.dtype), values)  # [N, Hkv, G, D]

    mapping = meta.block_mapping
    seq_sum = mapping.t().float() @ block_sum.view(num_blocks, -1)  # [bs, Hkv*G]
    if sinks is not None:
        seq_sum = seq_sum + torch.exp(sinks.float().view(1, -1) - seq_max[:bs].view(bs, -1))
    out = mapping.t() @ out_blk.reshape(num_blocks, -1)  # block2batch: [bs, Hkv*G*Dv]
    out = out.view(bs, num_kv_heads * groups, value_dim).float()
    # Pad rows have no blocks: guard their zero sum instead of dividing by it.
    out = out / seq_sum.clamp_min(1e-30).view(bs, num_kv_heads * groups, 1)
    return out.to(query.dtype)


def flat_paged_verify_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    softcap: float | None = None,
    window: int | None = None,
    chunk: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Flat paged attention with ``q`` query tokens per row (a speculative verify step:
    the last accepted token and the drafts after it). query ``[bs * q, Hq, D]`` -> same.

    The decode algorithm of :func:`flat_paged_attention` with the query axis carried along;
    ``block_bias`` is ``[N, q, block_size]``: the causal mask of each query within its
    row's blocks (written by the input builder, so the queries see their own fresh keys).
    """
    assert meta.block_list is not None and meta.block_mapping is not None
    assert meta.block_bias is not None and meta.block_groups is not None
    tokens, num_q_heads, head_dim = query.shape
    bs = meta.block_mapping.shape[1]
    q_len = tokens // bs
    num_kv_heads = k_cache.shape[1]
    groups = num_q_heads // num_kv_heads
    block_size = meta.block_size
    num_blocks = meta.block_list.shape[0]
    value_dim = v_cache.shape[-1]

    q_blk = meta.block_mapping @ (query * scale).reshape(bs, -1)
    # [N, Hkv, q * G, D]: every query of the row against the block's keys in one matmul
    q_blk = q_blk.view(num_blocks, q_len, num_kv_heads, groups, head_dim).permute(
        0, 2, 1, 3, 4).reshape(num_blocks, num_kv_heads, q_len * groups, head_dim)
    keys, values = _gather_blocks(k_cache, v_cache, meta.block_list)
    if keys.dtype != query.dtype:
        keys = keys.to(query.dtype)
        values = keys if v_cache is k_cache else values.to(query.dtype)

    scores = torch.matmul(q_blk, keys.transpose(-1, -2)).float()  # [N, Hkv, q*G, B]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.view(num_blocks, num_kv_heads, q_len, groups, block_size)
    bias = meta.block_bias  # [N, q, B]
    if window is not None:
        assert meta.block_start is not None
        distance = (meta.block_start.view(-1, 1, 1)
                    + torch.arange(block_size, device=bias.device).view(1, 1, -1)
                    - torch.arange(q_len, device=bias.device).view(1, -1, 1))
        bias = bias.masked_fill(distance <= -window, _MASKED)
    if chunk is not None:  # query i of a row sits at the row's first position + i
        assert meta.block_start is not None
        offsets = torch.arange(q_len, device=bias.device).view(1, -1, 1)
        distance = (meta.block_start.view(-1, 1, 1)
                    + torch.arange(block_size, device=bias.device).view(1, 1, -1) - offsets)
        query_pos = _block_query_pos(meta, bs).view(-1, 1, 1) + offsets
        bias = bias.masked_fill(_chunk_masked(distance, query_pos, chunk), _MASKED)
    scores = scores + bias.view(num_blocks, 1, q_len, 1, block_size)
    block_max = scores.amax(dim=-1)  # [N, Hkv, q, G]
    seq_max = _initial_max((bs + 1, num_kv_heads, q_len, groups), sinks, scores)
    index = meta.block_groups.view(-1, 1, 1, 1).expand_as(block_max)
    seq_max = seq_max.scatter_reduce(0, index, block_max, reduce="amax", include_self=True)
    block_seq_max = seq_max.index_select(0, meta.block_groups)
    probs = torch.exp((scores - block_seq_max.unsqueeze(-1)).clamp_min_(-80.0))
    block_sum = probs.sum(dim=-1)  # [N, Hkv, q, G]
    out_blk = torch.matmul(probs.to(values.dtype).view(num_blocks, num_kv_heads, -1,
                                                       block_size), values)
    mapping = meta.block_mapping
    seq_sum = mapping.t().float() @ block_sum.reshape(num_blocks, -1)  # [bs, Hkv*q*G]
    if sinks is not None:
        sink = sinks.float().view(1, num_kv_heads, 1, groups)
        seq_sum = seq_sum + torch.exp(sink - seq_max[:bs]).view(bs, -1)
    out = (mapping.t() @ out_blk.reshape(num_blocks, -1)).float()  # [bs, Hkv*q*G*D]
    out = out.view(bs, num_kv_heads, q_len, groups, value_dim)
    out = out / seq_sum.clamp_min(1e-30).view(bs, num_kv_heads, q_len, groups, 1)
    return out.permute(0, 2, 1, 3, 4).reshape(tokens, num_q_heads, value_dim).to(query.dtype)


def _initial_max(shape: tuple[int, ...], sinks: torch.Tensor | None, scores: torch.Tensor
                 ) -> torch.Tensor:
    """The running max each (row, kv head, [query,] group) starts from: -inf, or the query
    head's sink (``[Hq]``, head ``kv * G + g``), so that the sink's term exp(sink - max)
    never overflows."""
    if sinks is None:
        return torch.full(shape, float("-inf"), dtype=scores.dtype, device=scores.device)
    heads = sinks.float().view(shape[1], *([1] * (len(shape) - 3)), shape[-1])
    return heads.expand(shape).contiguous()
