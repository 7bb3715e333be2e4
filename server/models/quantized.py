"""Quantized Hugging Face checkpoints (GPTQ, AWQ int4; FP8), dequantized as they stream in.

Each format keeps a linear layer as several tensors (codes, scales, zero points...) in its own
documented layout; they are collected per module and turned into one ``weight`` for the
loader. The engine then serves the dequantized weights in ``--dtype`` (on CPU there is no int4
GEMM for these layouts nor an FP8 one; Gaudi's FP8 matmuls are future work).

Layouts (``bits`` = 4, ``pack`` = 32 // bits codes per int32, little end first):
- GPTQ: ``qweight`` int32 ``[in / pack, out]`` packed along the input; ``qzeros`` int32
  ``[groups, out / pack]`` packed along the output, stored minus one (v1 checkpoints);
  ``scales`` ``[groups, out]``; ``g_idx`` ``[in]`` the group of each input row (act-order).
- AWQ (GEMM): ``qweight`` int32 ``[in, out / pack]`` and ``qzeros`` ``[groups, out / pack]``
  packed along the output in the interleaved order 0 2 4 6 1 3 5 7; ``scales``
  ``[groups, out]``; groups of consecutive input rows.
- FP8: ``weight`` float8 e4m3 ``[out, in]`` with ``weight_scale`` (compressed-tensors:
  per tensor or per output channel) or ``weight_scale_inv`` (block-wise, 128 x 128 by default).
- MXFP4 (gpt-oss's experts, OCP microscaling): ``<name>_blocks`` uint8 ``[..., out, in / 32,
  16]``, two e2m1 codes per byte (low nibble first), and ``<name>_scales`` uint8 ``[..., out,
  in / 32]``, a shared power of two per 32 inputs biased by 127: weight = e2m1(code) *
  2^(scale - 127), as ``<name>`` ``[..., out, in]``.
In every int4 format: weight = (code - zero) * scale.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a packed int32 holds column ORDER[i]
METHODS = ("gptq", "awq", "fp8", "compressed-tensors", "mxfp4")
# the e2m1 (FP4) value of each 4-bit code: sign bit 3, then 2 exponent bits and 1 mantissa bit
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_MX_PARTS = ("_blocks", "_scales")

_PARTS = {
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "awq": ("qweight", "qzeros", "scales"),
    "fp8": ("weight", "weight_scale_inv"),
    "compressed-tensors": ("weight", "weight_scale"),
}
_REQUIRED = {"gptq": 3, "awq": 3, "fp8": 2, "compressed-tensors": 2}
# activation scales and the like: used by FP8 matmul kernels, not by dequantized weights
_IGNORED = ("input_scale", "output_scale", "k_scale", "v_scale")


@dataclass(frozen=True, slots=True)
class QuantConfig:
    """What ``config.json``'s ``quantization_config`` says about the weights."""

    method: str
    bits: int = 4
    group_size: int = 128
    block: tuple[int, int] = (128, 128)  # fp8 weight_scale_inv blocks

    @classmethod
    def from_hf(cls, qc: dict[str, Any] | None) -> QuantConfig | None:
        if not qc:
            return None
        method = str(qc.get("quant_method", "")).lower()
        if method not in METHODS:
            raise ValueError(f"unsupported quantization {method!r} in config.json; "
                             f"supported: {', '.join(METHODS)}")
        if method == "compressed-tensors":
            _check_compressed_tensors(qc)
        bits = int(qc.get("bits", qc.get("w_bit", 4)) or 4)
        if method in ("gptq", "awq") and bits != 4:
            raise ValueError(f"{method} with {bits}-bit weights is not supported (4-bit only)")
        if method == "awq" and str(qc.get("version", "gemm")).lower() != "gemm":
            raise ValueError("AWQ checkpoints in the GEMM layout only")
        group = int(qc.get("group_size", qc.get("q_group_size", 128)) or -1)
        block = tuple(qc.get("weight_block_size") or (128, 128))
        return cls(method, bits, group, (int(block[0]), int(block[1])))


def _check_compressed_tensors(qc: dict[str, Any]) -> None:
    for name, group in (qc.get("config_groups") or {}).items():
        weights = group.get("weights") or {}
        if weights.get("type") != "float" or weights.get("num_bits") != 8:
            raise ValueError(f"compressed-tensors group {name!r}: only 8-bit float weights "
                             "(FP8) are supported")
        if weights.get("strategy") not in ("tensor", "channel"):
            raise ValueError(f"compressed-tensors group {name!r}: weight scales per tensor "
                             f"or per channel only, not {weights.get('strategy')!r}")


def dequantized(tensors: Iterator[tuple[str, torch.Tensor]], qc: QuantConfig
                ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with each quantized linear layer's parts replaced by its
    dequantized ``weight`` (float32); other tensors pass through."""
    if qc.method == "mxfp4":
        yield from _mxfp4_tensors(tensors)
        return
    parts = _PARTS[qc.method]
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        prefix, _, leaf = name.rpartition(".")
        if leaf in _IGNORED:
            continue
        if leaf not in parts or (leaf == "weight" and not tensor.dtype.is_floating_point) or \
                (leaf == "weight" and tensor.element_size() != 1):
            yield name, tensor  # norms, embeddings, biases, unquantized layers
            continue
        module = pending.setdefault(prefix, {})
        module[leaf] = tensor
        if _complete(module, qc):
            yield f"{prefix}.weight", _dequantize(pending.pop(prefix), qc)
    leftover = [p for p, m in pending.items() if m]
    for prefix in leftover:  # g_idx is optional: GPTQ modules without it end here
        module = pending[prefix]
        if len([k for k in module if k != "g_idx"]) >= _REQUIRED[qc.method]:
            yield f"{prefix}.weight", _dequantize(module, qc)
        else:
            raise ValueError(f"{prefix}: incomplete {qc.method} tensors {sorted(module)}")


def _mxfp4_tensors(tensors: Iterator[tuple[str, torch.Tensor]]
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """Each ``X_blocks`` / ``X_scales`` pair as the dequantized ``X``; the rest as it is."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        part = next((p for p in _MX_PARTS if name.endswith(p)), None)
        if part is None:
            yield name, tensor
            continue
        base = name.removesuffix(part)
        pair = pending.setdefault(base, {})
        pair[part] = tensor
        if len(pair) == 2:
            del pending[base]
            yield base, mxfp4_dequantize(pair["_blocks"], pair["_scales"])
    if pending:
        base, pair = next(iter(pending.items()))
        raise ValueError(f"{base}: MXFP4 tensors without their pair ({', '.join(pair)} only)")


def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 ``blocks [..., G, 16]`` uint8 and ``scales [..., G]`` uint8 -> float32
    ``[..., G * 32]`` (meta tensors in, a meta tensor out: the checkpoint check)."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} do not match scales "
                         f"{list(scales.shape)} (blocks of 16 bytes, one scale each)")
    shape = (*scales.shape[:-1], scales.shape[-1] * 32)
    if blocks.is_meta:
        return torch.empty(shape, dtype=torch.float32, device="meta")
    codes = blocks.to(torch.uint8)
    lut = torch.tensor(E2M1, dtype=torch.float32, device=blocks.device)
    # [..., G, 16, 2]: byte j holds inputs 2j (low nibble) and 2j + 1 (high nibble)
    values = lut[torch.stack([codes & 0x0F, codes >> 4], dim=-1).long()]
    values = torch.ldexp(values, (scales.to(torch.int32) - 127).unsqueeze(-1).unsqueeze(-1))
    return values.reshape(shape)


def _complete(module: dict[str, torch.Tensor], qc: QuantConfig) -> bool:
    return all(part in module for part in _PARTS[qc.method])


def _dequantize(module: dict[str, torch.Tensor], qc: QuantConfig) -> torch.Tensor:
    if qc.method == "gptq":
        return _gptq(module, qc)
    if qc.method == "awq":
        return _awq(module, qc)
    weight = module["weight"].float()
    if qc.method == "compressed-tensors":
        scale = module["weight_scale"].float()  # per tensor, or per output channel
        return weight * (scale.reshape(()) if scale.numel() == 1 else scale.reshape(-1, 1))
    scale_inv = module["weight_scale_inv"].float()
    rows, cols = qc.block
    full = scale_inv.repeat_interleave(rows, 0).repeat_interleave(cols, 1)
    return weight * full[: weight.shape[0], : weight.shape[1]]


def unpack(packed: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None
           ) -> torch.Tensor:
    """int32 codes -> one int32 per code, unpacked along ``dim`` (code i of a word at
    position ``order[i]`` of its group of 32 // bits)."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    codes = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., per_word]
    if order is not None:
        codes = codes[..., list(_inverse(order))]
    if dim == 0:
        return codes.permute(0, 2, 1).reshape(packed.shape[0] * per_word, packed.shape[1])
    return codes.reshape(packed.shape[0], packed.shape[1] * per_word)


def _inverse(order: tuple[int, ...]) -> tuple[int, ...]:
    inverse = [0] * len(order)
    for position, column in enumerate(order):
        inverse[column] = position
    return tuple(inverse)


def _gptq(module: dict[str, torch.Tensor], qc: QuantConfig) -> torch.Tensor:
    codes = unpack(module["qweight"], qc.bits, dim=0)  # [in, out]
    zeros = unpack(module["qzeros"], qc.bits, dim=1) + 1  # v1 stores zero - 1
    scales = module["scales"].float()
    rows = codes.shape[0]
    g_idx = module.get("g_idx")
    if g_idx is None:
        group = qc.group_size if qc.group_size > 0 else rows
        g_idx = torch.arange(rows) // group
    g_idx = g_idx.long()
    weight = (codes - zeros[g_idx]).float() * scales[g_idx]
    return weight.t().contiguous()  # [out, in], as nn.Linear keeps it


def _awq(module: dict[str, torch.Tensor], qc: QuantConfig) -> torch.Tensor:
    codes = unpack(module["qweight"], qc.bits, dim=1, order=AWQ_ORDER)  # [in, out]
    zeros = unpack(module["qzeros"], qc.bits, dim=1, order=AWQ_ORDER)  # [groups, out]
    scales = module["scales"].float()
    rows = codes.shape[0]
    group = qc.group_size if qc.group_size > 0 else rows
    g_idx = torch.arange(rows) // group
    weight = (codes - zeros[g_idx]).float() * scales[g_idx]
    return weight.t().contiguous()
