"""The 4-bit weights of a GGUF file, kept 4-bit: Q4_0 / Q4_1 blocks as integer codes plus
one (scale, zero) pair per 32 inputs.

``w = (q - 8) * scale + zero`` with ``q`` in 0..15 represents both formats exactly (Q4_0:
``d * (q - 8)``; Q4_1: ``d * q + m``), and is the convention of torch's int4 weight-only
matmul kernels. Rows go through the same Q/K un-permutation and q/k/v, gate/up fusion as
the dequantized weights, so a module's codes line up with its dense weight row for row.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import torch

from server.models.config import ModelConfig

GROUP_SIZE = 32  # GGUF's block length along the input dimension

_FUSED = {
    "attn_q": ("self_attn.qkv_proj", 0), "attn_k": ("self_attn.qkv_proj", 1),
    "attn_v": ("self_attn.qkv_proj", 2), "ffn_gate": ("mlp.gate_up_proj", 0),
    "ffn_up": ("mlp.gate_up_proj", 1), "attn_output": ("self_attn.o_proj", 0),
    "ffn_down": ("mlp.down_proj", 0),
}
_SHARDS = {"self_attn.qkv_proj": 3, "mlp.gate_up_proj": 2, "self_attn.o_proj": 1,
           "mlp.down_proj": 1}


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


def _split_blocks(data: np.ndarray, type_name: str) -> tuple[np.ndarray, ...]:
    """Raw rows ``[N, blocks * bytes]`` -> codes ``[N, K]``, scale and zero ``[N, blocks]``."""
    width = 18 if type_name == "Q4_0" else 20
    blocks = data.reshape(data.shape[0], -1, width)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if type_name == "Q4_0":
        zero = np.zeros_like(d)
        packed = blocks[..., 2:]
    else:
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        zero = m + 8 * d
        packed = blocks[..., 4:]
    # Within a block, byte j holds element j in its low nibble and element j + 16 high.
    codes = np.concatenate([packed & 0x0F, packed >> 4], axis=-1)
    return codes.reshape(data.shape[0], -1), d, zero


def _unpermute_rows(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    rows = t.shape[0]
    return t.reshape(num_heads, rows // num_heads // 2, 2, -1).transpose(1, 2).reshape(t.shape)


def read_int4_weights(reader: object, cfg: ModelConfig) -> dict[str, Int4Weight]:
    """Module name (``layers.3.mlp.down_proj``) -> its weight, for every linear layer whose
    shards are all Q4_0/Q4_1 in the file; layers with any other shard type are left out."""
    unpermute = cfg.model_type != "qwen2"  # see loader._gguf_tensors
    shards: dict[str, dict[int, tuple[torch.Tensor, ...]]] = {}
    rejected: set[str] = set()
    for t in reader.tensors:
        match = re.match(r"blk\.(\d+)\.(\w+)\.weight$", t.name)
        if match is None or match.group(2) not in _FUSED:
            continue
        part = match.group(2)
        module, shard = _FUSED[part]
        name = f"layers.{match.group(1)}.{module}"
        if t.tensor_type.name not in ("Q4_0", "Q4_1"):
            rejected.add(name)
            continue
        codes, scale, zero = (torch.from_numpy(a) for a in _split_blocks(t.data, t.tensor_type.name))
        if unpermute and part in ("attn_q", "attn_k"):
            heads = cfg.num_heads if part == "attn_q" else cfg.num_kv_heads
            codes, scale, zero = (_unpermute_rows(a, heads) for a in (codes, scale, zero))
        shards.setdefault(name, {})[shard] = (codes, scale, zero)
    weights = {}
    for name, parts in shards.items():
        if name in rejected or len(parts) != _SHARDS[name.split(".", 2)[2]]:
            continue
        ordered = [parts[i] for i in range(len(parts))]
        weights[name] = Int4Weight(*(torch.cat(col).contiguous() for col in zip(*ordered)))
    return weights
