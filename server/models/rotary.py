"""Rotary position embeddings and their scaling variants: linear, dynamic NTK, YaRN, Llama
3.1's "llama3", and Phi-3's LongRoPE.

Tables are precomputed per position, so a variant is a choice of inverse frequencies (and of
an attention factor folded into cos/sin), possibly different above a position boundary.
"""

from __future__ import annotations

import math
from typing import Any

import torch

SUPPORTED = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")


def _base_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` (float32) of the first position segment."""
    return rope_segments(head_dim, theta, scaling, 0)[0][0][1]


def rope_segments(head_dim: int, theta: float, scaling: dict[str, Any] | None,
                  max_positions: int) -> tuple[list[tuple[int, torch.Tensor]], float]:
    """``([(first position, inv_freq float32), ...], attention factor)`` of a variant."""
    inv_freq = _base_inv_freq(head_dim, theta)
    rope_type = (scaling or {}).get("rope_type", "default")
    if scaling is None or rope_type == "default":
        return [(0, inv_freq.float())], 1.0
    if rope_type == "linear":
        return [(0, (inv_freq / float(scaling["factor"])).float())], 1.0
    if rope_type == "dynamic":
        # Dynamic NTK only rescales beyond max_position_embeddings, which also caps the
        # context served: within it the frequencies are the plain ones.
        return [(0, inv_freq.float())], 1.0
    if rope_type == "llama3":
        return [(0, _llama3_inv_freq(inv_freq, scaling).float())], 1.0
    if rope_type == "yarn":
        return _yarn(inv_freq, head_dim, theta, scaling, max_positions)
    if rope_type == "longrope":
        return _longrope(inv_freq, scaling, max_positions)
    raise ValueError(f"unsupported rope scaling type {rope_type!r} (supported: "
                     f"{', '.join(SUPPORTED)})")


def _yarn(inv_freq: torch.Tensor, head_dim: int, theta: float, scaling: dict[str, Any],
          max_positions: int) -> tuple[list[tuple[int, torch.Tensor]], float]:
    # Frequencies that turn fewer than beta_slow times over the original context are
    # interpolated (divided by factor), those turning more than beta_fast times kept, a
    # linear ramp between; attention is sharpened by ~0.1 ln(factor) + 1.
    factor = float(scaling["factor"])
    original = float(scaling.get("original_max_position_embeddings") or max_positions)
    beta_fast = float(scaling.get("beta_fast") or 32.0)
    beta_slow = float(scaling.get("beta_slow") or 1.0)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 0.1 * m * math.log(scale) + 1.0 if scale > 1 else 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = (mscale(factor, m) / mscale(factor, m_all) if m and m_all
                     else mscale(factor))

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate
    blended = inv_freq / factor * (1 - keep) + inv_freq * keep
    return [(0, blended.float())], float(attention)


def _longrope(inv_freq: torch.Tensor, scaling: dict[str, Any], max_positions: int
              ) -> tuple[list[tuple[int, torch.Tensor]], float]:
    # Per-frequency divisors learned for short and long contexts (Phi-3): positions within
    # the original context use the short ones, positions beyond it the long ones.
    original = int(scaling["original_max_position_embeddings"])
    short = torch.tensor(scaling["short_factor"], dtype=torch.float64)
    long = torch.tensor(scaling["long_factor"], dtype=torch.float64)
    factor = max_positions / original if max_positions else 1.0
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
    return [(0, (inv_freq / short).float()), (original, (inv_freq / long).float())], \
        float(attention)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between blended:
    # this is how Llama 3.1 stretches an 8k-trained RoPE to 128k.
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling.get("original_max_position_embeddings", 8192))
    low_freq_wavelen = old_len / low_freq_factor
    high_freq_wavelen = old_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin tables indexed by position; applied in the rotate-half layout."""

    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None
    ) -> None:
        super().__init__()
        self.max_positions = max_positions
        segments, self.attention_factor = rope_segments(head_dim, theta, scaling,
                                                        max_positions)
        self.starts = [start for start, _ in segments]
        inv_freqs = torch.stack([inv for _, inv in segments])
        cos, sin = self._tables(inv_freqs)
        self.register_buffer("inv_freqs", inv_freqs, persistent=False)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    @property
    def inv_freq(self) -> torch.Tensor:
        return self.inv_freqs[0]

    def _tables(self, inv_freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.arange(self.max_positions, dtype=torch.float32, device=inv_freqs.device)
        # each position takes the frequencies of the last segment starting at or before it
        segment = torch.zeros(self.max_positions, dtype=torch.long, device=inv_freqs.device)
        for i, start in enumerate(self.starts[1:], 1):
            segment[start:] = i
        freqs = t.unsqueeze(1) * inv_freqs[segment]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.attention_factor, emb.sin() * self.attention_factor

    def apply_freq_factors(self, factors: torch.Tensor) -> None:
        """llama.cpp's ``rope_freqs`` tensor: per-frequency divisors (how GGUF files carry
        Llama 3.1's RoPE scaling)."""
        self.inv_freqs = self.inv_freqs / factors.to(self.inv_freqs)
        self.cos, self.sin = self._tables(self.inv_freqs)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[T, 1, D]`` for positions of T tokens (any shape), looked up once per
        forward pass and shared by every layer. Tables are float32; like the reference
        implementation, the rotation itself runs in the activations' dtype."""
        positions = positions.reshape(-1)
        cos = self.cos.index_select(0, positions).unsqueeze(1).to(dtype)
        sin = self.sin.index_select(0, positions).unsqueeze(1).to(dtype)
        return cos, sin


class MRotaryEmbedding(RotaryEmbedding):
    """M-RoPE (Qwen2-VL / Qwen2.5-VL): each token has three positions (temporal, height,
    width; equal for text), and the frequencies come in three sections, each rotated by
    one of them. Positions ``[3, ...]``; the result is plain per-token cos/sin, so the
    layers and their kernels are those of RoPE."""

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None, section: tuple[int, ...]) -> None:
        super().__init__(head_dim, max_positions, theta, scaling)
        # which of the three positions rotates each of the D dims (both halves alike)
        axis = torch.cat([torch.full((n,), i) for i, n in enumerate(section)])
        self.register_buffer("axis", torch.cat([axis, axis]).view(1, 1, -1), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        flat = positions.reshape(3, -1)
        pick = self.axis.to(flat.device).expand(1, flat.shape[1], -1)

        def lookup(table: torch.Tensor) -> torch.Tensor:
            per_axis = table.index_select(0, flat.reshape(-1)).view(3, flat.shape[1], -1)
            return per_axis.gather(0, pick).squeeze(0).unsqueeze(1).to(dtype)

        return lookup(self.cos), lookup(self.sin)


def interleaved_to_halves(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The q or k rows of each head (``[heads * D, ...]``, whole heads) from the layout of
    RoPE over interleaved pairs ``(x0, x1), (x2, x3)...`` (Meta's complex form, Llama 4) to
    the rotate-half layout ``[x0, x2, ..., x1, x3, ...]`` the RoPE kernels rotate. q and k
    reordered alike keep their dot products (and norms) unchanged."""
    order = torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])
    heads = rows.shape[0] // head_dim
    return rows.reshape(heads, head_dim, *rows.shape[1:])[:, order.to(rows.device)] \
        .reshape(rows.shape)
