"""A GGUF's 4-bit weights kept as codes for torch's int4 weight-only kernel.

The kernel's convention is ``w = (q - 8) * scale + zero`` with ``q`` in 0..15 and one
(scale, zero) per group of 32 inputs. Three GGUF types are exactly that:

- Q4_0, blocks of 32: ``d * (q - 8)`` -> scale ``d``, zero 0;
- Q4_1, blocks of 32: ``d * q + m`` -> scale ``d``, zero ``m + 8d``;
- Q4_K, super-blocks of 256 = 8 sub-blocks of 32, each ``d * sc_j * q - dmin * m_j`` with
  6-bit ``sc_j`` / ``m_j`` -> scale ``d * sc_j``, zero ``8 d sc_j - dmin m_j``.

A Q8_0 LM head (``output.weight``, or ``token_embd.weight`` when the embeddings are tied),
``d * q`` with int8 ``q`` per block of 32, is kept as its codes too, for our Q8_0 kernel (the
CPU backend's ``q8_pack.py``): it is the largest single read of a small decode step.

Other types are served from the dequantized copy only: Q5_0/Q5_1/Q5_K and Q6_K have 5- and
6-bit codes, and Q8_0 linear layers inside the blocks run dense. Expert tensors (MoE) are
dequantized too: moe.py runs dense stacked weights.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from server.models.config import ModelConfig
from server.models.gguf_tensors import block_names, parse_block_tensor, q_or_k_heads, unpermute

GROUP_SIZE = 32  # the int4 kernel's group: GGUF's block (Q4_0/Q4_1) or sub-block (Q4_K)
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")

# HF module -> (our fused module, its shard, how many shards it has)
_FUSED_MODULES = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0, 3),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1, 3),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2, 3),
    "self_attn.qkv_proj": ("self_attn.qkv_proj", 0, 1),
    "self_attn.o_proj": ("self_attn.o_proj", 0, 1),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0, 2),
    "mlp.up_proj": ("mlp.gate_up_proj", 1, 2),
    "mlp.gate_up_proj": ("mlp.gate_up_proj", 0, 1),
    "mlp.down_proj": ("mlp.down_proj", 0, 1),
}


@dataclass(slots=True)
class Int4Weight:
    """One linear layer's weight as 4-bit codes: ``codes`` uint8 ``[N, K]`` (0..15),
    ``scale`` / ``zero`` float32 ``[N, K // GROUP_SIZE]``."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        scale = self.scale.repeat_interleave(GROUP_SIZE, dim=1)
        zero = self.zero.repeat_interleave(GROUP_SIZE, dim=1)
        return (self.codes.float() - 8) * scale + zero


@dataclass(slots=True)
class Q8Weight:
    """A linear layer's weight as GGUF Q8_0 codes: ``codes`` int8 ``[N, K]``, ``scale``
    float32 ``[N, K // 32]``; ``w = codes * scale``."""

    codes: torch.Tensor
    scale: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        return self.codes.float() * self.scale.repeat_interleave(GROUP_SIZE, dim=1)


HEAD = "lm_head"  # the module name a Q8_0 head's codes are keyed by


def _f16(raw: np.ndarray) -> np.ndarray:
    """Little-endian fp16 from the last axis' 2 bytes, as float32."""
    return raw.copy().view(np.float16)[..., 0].astype(np.float32)


def _split_q4_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K super-blocks ``[N, S, 144]`` -> codes ``[N, S * 256]``, scale/zero ``[N, S * 8]``."""
    rows = blocks.shape[0]
    d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
    s = blocks[..., 4:16]
    # 12 bytes hold eight 6-bit scales and mins: sub-blocks 0-3 in the low 6 bits of bytes
    # 0-3 (scales) and 4-7 (mins); sub-blocks 4-7 in bytes 8-11's nibbles (low 4 bits)
    # and the top 2 bits of bytes 0-3 / 4-7 (high 2 bits).
    lo, hi, mix = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([lo & 0x3F, (mix & 0x0F) | ((lo >> 6) << 4)], axis=-1)
    mn = np.concatenate([hi & 0x3F, (mix >> 4) | ((hi >> 6) << 4)], axis=-1)
    scale = d[..., None] * sc.astype(np.float32)  # [N, S, 8]
    offset = dmin[..., None] * mn.astype(np.float32)
    # 128 code bytes as 4 chunks of 32: a chunk's low nibbles are sub-block 2c (elements
    # 0-31 of its 64), its high nibbles sub-block 2c + 1.
    qs = blocks[..., 16:].reshape(rows, -1, 4, 1, 32)
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-2)  # [N, S, 4, 2, 32]
    return (codes.reshape(rows, -1), scale.reshape(rows, -1),
            (8 * scale - offset).reshape(rows, -1))


def split_blocks(data: np.ndarray, type_name: str) -> tuple[np.ndarray, ...]:
    """Raw rows ``[N, bytes]`` of a Q4_0 / Q4_1 / Q4_K tensor -> codes uint8 ``[N, K]``,
    scale and zero float32 ``[N, K // 32]``, such that ``(codes - 8) * scale + zero`` is
    llama.cpp's dequantization (up to float32 rounding)."""
    rows = data.shape[0]
    if type_name == "Q4_K":
        return _split_q4_k(data.reshape(rows, -1, 144))
    width = 18 if type_name == "Q4_0" else 20
    blocks = data.reshape(rows, -1, width)
    d = _f16(blocks[..., 0:2])
    if type_name == "Q4_0":
        zero = np.zeros_like(d)
        packed = blocks[..., 2:]
    else:
        zero = _f16(blocks[..., 2:4]) + 8 * d
        packed = blocks[..., 4:]
    # Within a block, byte j holds element j in its low nibble and element j + 16 high.
    codes = np.concatenate([packed & 0x0F, packed >> 4], axis=-1)
    return codes.reshape(rows, -1), d, zero


def split_q8_0(data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Raw Q8_0 rows ``[N, bytes]`` (per block of 32: an fp16 ``d``, then 32 int8 codes) ->
    codes int8 ``[N, K]`` and scale float32 ``[N, K // 32]``."""
    rows = data.shape[0]
    blocks = data.reshape(rows, -1, 34)
    codes = blocks[..., 2:].copy().view(np.int8)
    return codes.reshape(rows, -1), _f16(blocks[..., 0:2])


def read_q8_head(reader: Any, cfg: ModelConfig) -> Q8Weight | None:
    """The LM head as Q8_0 codes, where the file stores it so: ``output.weight``, or the tied
    ``token_embd.weight``; None otherwise."""
    tensors = {t.name: t for t in reader.tensors}
    head = tensors.get("output.weight")
    if head is None and cfg.tie_word_embeddings:
        head = tensors.get("token_embd.weight")
    if head is None or head.tensor_type.name != "Q8_0":
        return None
    codes, scale = split_q8_0(np.asarray(head.data))
    return Q8Weight(torch.from_numpy(codes), torch.from_numpy(scale))


def read_int4_weights(reader: Any, cfg: ModelConfig) -> dict[str, Int4Weight]:
    """Module name (``layers.3.mlp.down_proj``) -> its weight, for every linear layer whose
    shards are all Q4_0/Q4_1/Q4_K in the file; layers with any other shard type are left
    out (they run from the dequantized weight only)."""
    names = block_names(cfg)
    shards: dict[str, dict[int, tuple[torch.Tensor, ...]]] = {}
    expected: dict[str, int] = {}
    rejected: set[str] = set()
    for t in reader.tensors:
        parsed = parse_block_tensor(t.name, names)
        if parsed is None or parsed[3] != "weight" or parsed[2] not in _FUSED_MODULES:
            continue
        layer, part, module, _ = parsed
        fused, shard, count = _FUSED_MODULES[module]
        name = f"layers.{layer}.{fused}"
        expected[name] = count
        if t.tensor_type.name not in INT4_TYPES:
            rejected.add(name)
            continue
        codes, scale, zero = (torch.from_numpy(a) for a in split_blocks(t.data, t.tensor_type.name))
        heads = q_or_k_heads(part, cfg)
        if heads is not None:
            codes, scale, zero = (unpermute(a, heads) for a in (codes, scale, zero))
        shards.setdefault(name, {})[shard] = (codes, scale, zero)
    weights = {}
    for name, parts in shards.items():
        if name in rejected or len(parts) != expected[name]:
            continue
        ordered = [parts[i] for i in range(len(parts))]
        weights[name] = Int4Weight(*(torch.cat(col).contiguous() for col in zip(*ordered)))
    return weights


def tensor_types(reader: Any) -> Counter[str]:
    """How many tensors of each GGML type the file holds (the load log's summary)."""
    return Counter(t.tensor_type.name for t in reader.tensors)


def dequantized_only(reader: Any, cfg: ModelConfig,
                     weights: dict[str, Int4Weight | Q8Weight]) -> Counter[str]:
    """Quantized tensors (by type) that no kept codes came from: served from their
    dequantized copy only (other types, experts, embeddings and head, or a layer with a
    shard in another type)."""
    names = block_names(cfg)
    counts: Counter[str] = Counter()
    head = "output.weight" if any(t.name == "output.weight" for t in reader.tensors) \
        else "token_embd.weight"
    for t in reader.tensors:
        kind = t.tensor_type.name
        if kind in ("F32", "F16", "BF16") or (t.name == head and HEAD in weights):
            continue
        parsed = parse_block_tensor(t.name, names)
        fused = _FUSED_MODULES.get(parsed[2]) if parsed is not None else None
        if fused is None or f"layers.{parsed[0]}.{fused[0]}" not in weights:
            counts[kind] += 1
    return counts
