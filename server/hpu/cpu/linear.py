"""Linear layers with weights pre-packed in oneDNN's blocked layout, for eager CPU serving.

A plain ``F.linear`` on CPU hands oneDNN a row-major weight, which it re-blocks on every
call; decode GEMMs are skinny (a few rows against a large weight), so that per-call work is
a large share of the step. Packing once at load time removes it (measured on the SmolLM2
linear stack: 1.2x at 1 row, 1.5-1.9x at 16-32 rows, bf16 results bit-identical). This is
the same packing inductor applies when it freezes a CPU graph, so only eager mode needs it.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Mapping
from typing import Protocol

import torch
from torch import nn

from server.hpu.cpu.bf16_pack import PackedBf16, bf16_linear, pack_bf16
from server.hpu.cpu.host_memory import advise_around
from server.hpu.cpu.int4_pack import PackedInt4, int4_linear, pack_int4
from server.hpu.cpu.q8_pack import pack_q8, q8_linear

logger = logging.getLogger(__name__)

_PACKABLE_DTYPES = (torch.bfloat16, torch.float32)
# Largest batch (rows) served from int4 codes; measured crossovers against the dense bf16
# weight (benchmarks/int4_gemm.py): aten's int4 kernel, and ours (csrc/int4_gemm.cpp, which
# decodes the codes once for all rows of a call). A speculative verify step of one sequence
# (k + 1 rows) is served from them too, whatever k (see int4_max_rows): both kernels' rows
# are independent, so a row's result is the same bits at 1 row or 9, and a verify step
# scores its drafts with the plain decode's numerics.
INT4_MAX_ROWS = 4
INT4_KERNEL_MAX_ROWS = 16
# Ours, where the layer also holds the bf16 kernel's copy: past this the bf16 kernel is
# faster (SmolLM2's stack, 2 threads, 2026-11-27: int4 7.5 / 10.9 / 13.3 ms at 8 / 12 / 16
# rows, bf16 8.0 / 9.9 / 11.0).
INT4_BESIDE_BF16_MAX_ROWS = 8
# Largest batch served by the bf16 small-batch kernel (csrc/bf16_gemm.cpp). One pass over
# the weight holds 8 rows; more rows take more passes, the weight tile re-read from cache
# while the next tile is fetched. SmolLM2's 30 layers, 2 threads (benchmarks/bf16_gemm.py,
# 2026-11-27, after that fetch): 9.9 vs oneDNN's 14.9 ms at 12 rows, 11.0 / 17.3 at 16,
# 19.1 / 24.6 at 32, 36.7 / 41.1 at 64; the LM head (49152 x 576) 4.8 / 5.3 ms at 32 but
# 9.5 / 9.4 at 64. At 96-512 rows the layers are within 5% of oneDNN: oneDNN from there.
BF16_KERNEL_MAX_ROWS = 64
BF16_HEAD_MAX_ROWS = 32
# Largest batch served from a Q8_0 LM head's codes (csrc/q8_gemm.cpp). SmolLM2's head
# (49152 x 576), 2 threads: 0.72 ms against the bf16 kernel's 1.85 and oneDNN's 1.83 at 1
# row, 1.22 vs 1.81 at 4, a tie at 8, slower past it (two products per code and row).
Q8_KERNEL_MAX_ROWS = 8


def int4_max_rows(decode_query: int, kernel: bool = False, beside_bf16: bool = False) -> int:
    """Rows served from int4 codes when a decode step carries up to ``decode_query`` tokens
    per sequence: the plain crossover (of our kernel or aten's; ``beside_bf16``: against
    the bf16 kernel's copy rather than oneDNN), or one sequence's verify step if that is
    larger. With speculation (``decode_query`` > 1) our kernel keeps 16 rows even beside
    the bf16 copy: a small batch's verify steps (3 sequences x 4 tokens) then run the
    codes, as its plain decode steps do, so speculative greedy text stays plain greedy text."""
    if not kernel:
        return max(INT4_MAX_ROWS, decode_query)
    plain = beside_bf16 and decode_query == 1
    return max(INT4_BESIDE_BF16_MAX_ROWS if plain else INT4_KERNEL_MAX_ROWS, decode_query)


def bf16_max_rows(decode_query: int, head: bool = False) -> int:
    """Rows served by the bf16 small-batch kernel (``head``: in the LM head): the measured
    crossover, or one sequence's verify step if that is larger (its rows then scored with
    plain decoding's numerics)."""
    return max(BF16_HEAD_MAX_ROWS if head else BF16_KERNEL_MAX_ROWS, decode_query)


def q8_max_rows(decode_query: int) -> int:
    """Rows served from Q8_0 codes: the crossover, or one sequence's verify step."""
    return max(Q8_KERNEL_MAX_ROWS, decode_query)


def packing_supported(dtype: torch.dtype) -> bool:
    """oneDNN present, the dtype one it packs, and bf16 only where the CPU computes it."""
    if dtype not in _PACKABLE_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    return dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


class PackedLinear(nn.Module):
    """``y = act(x W^T + b)`` with ``W`` held as an opaque oneDNN tensor (not a parameter).

    ``activation`` ("none", "gelu", "relu"; ``algorithm`` "none" or "tanh" for gelu) is
    applied inside the GEMM's epilogue: one pass over the output instead of two.
    """

    def __init__(self, linear: nn.Linear, activation: str = "none",
                 algorithm: str = "", small_rows: int = 0) -> None:
        super().__init__()
        weight = linear.weight.detach()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        # The batch-size hint only picks the blocking; measured equally fast from 1 to 256
        # rows with hint 1, so decode's small batches get the tuned layout.
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 1)
        # onto 2 MiB pages where oneDNN put it, in the background (see host_memory.py):
        # collapsed at once, 3-8% off decode steps of 16 to 64 rows (SmolLM2 bf16, A/B)
        advise_around(torch.ops.mkldnn.data_ptr(self.packed_weight),
                      torch.ops.mkldnn._nbytes(self.packed_weight))
        bias = linear.bias
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.weight_numel = weight.numel()
        self.activation = activation
        self.algorithm = algorithm
        # batches of up to small_rows rows: the bf16 kernel's copy (see pack_linear_layers)
        self.small_rows = small_rows if activation == "none" else 0
        self.small: PackedBf16 | None = None
        if self.small_rows:
            self.small = pack_bf16(weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.small is not None and x.numel() <= self.small_rows * self.in_features:
            return bf16_linear(x, self.small)  # any leading dims, any strides
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias,
                                                  self.activation, [], self.algorithm)

    def extra_repr(self) -> str:
        act = "" if self.activation == "none" else f", {self.activation}"
        small = f", bf16 kernel up to {self.small_rows} rows" if self.small is not None else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"packed{act}{small}")


def pack_linear_layers(model: nn.Module, small_rows: int = 0,
                       head_rows: int | None = None) -> int:
    """Swap every ``nn.Linear`` of ``model`` for a :class:`PackedLinear`, in place.

    ``small_rows`` > 0 (bfloat16 weights, the fused kernels loaded): each layer also keeps a
    copy for the bf16 small-batch kernel, run for batches of up to ``small_rows`` rows:
    faster than oneDNN there, and a row's result does not depend on the batch (exact
    speculative verify); the LM head up to ``head_rows`` (default: ``small_rows``). Layers
    that get a checkpoint's 4-bit codes later keep it too: the codes serve the fewest rows,
    this copy the batches between them and oneDNN.
    Returns how many were packed; 0 (model untouched) where this torch build or CPU cannot.
    Tied weights stay intact: the embedding keeps the dense tensor, the head gets a packed
    copy.
    """
    linears = [(name, m) for name, m in model.named_modules() if type(m) is nn.Linear]
    if not linears or not packing_supported(linears[0][1].weight.dtype):
        return 0
    if any(m.weight.device.type != "cpu" for _, m in linears):
        return 0
    if linears[0][1].weight.dtype != torch.bfloat16:
        small_rows = 0
    small_bytes = 0
    for name, linear in linears:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        rows = min(small_rows, head_rows) if attr == "lm_head" and head_rows is not None \
            else small_rows
        packed = PackedLinear(linear, small_rows=rows)
        if packed.small is not None:
            small_bytes += packed.small.weight.numel() * 2
        setattr(parent, attr, packed)
    logger.info("Packed %d linear layers into oneDNN's blocked layout", len(linears))
    if small_bytes:
        logger.info("bf16 small-batch kernel for batches of up to %d rows: its own copy of "
                    "the dense linear weights, %.1f MiB", small_rows, small_bytes / 2**20)
    return len(linears)


class Int4Codes(Protocol):
    """A weight as 4-bit codes: ``w = (codes - 8) * scale + zero``, one (scale, zero) per
    ``group_size`` inputs; codes ``[N, K]`` in 0..15, scale / zero ``[N, K // group]``."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor


class CodesLinear(nn.Module, abc.ABC):
    """A packed dense linear (``dense``) plus the same weight as the checkpoint's own codes,
    which serve batches of up to ``max_rows`` rows (``small_batch``: ``[rows, in]`` ->
    ``[rows, out]``, the bias added after); bigger batches run the dense GEMM."""

    dense: nn.Module
    in_features: int
    out_features: int
    max_rows: int
    bias: torch.Tensor | None

    @abc.abstractmethod
    def small_batch(self, flat: torch.Tensor) -> torch.Tensor:
        """``[rows, in_features]`` -> ``[rows, out_features]`` from the codes, no bias."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows > self.max_rows:
            return self.dense(x)
        out = self.small_batch(x.reshape(rows, self.in_features))
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)


class SmallBatchInt4Linear(CodesLinear):
    """A packed dense linear plus the same weight as int4 codes, used for small batches.

    Decode at a few rows is bound by reading weights: the int4 codes are a quarter of the
    bf16 bytes, so up to ``max_rows`` rows run them, bigger batches (prefill, loaded decode)
    the dense GEMM. Two int4 kernels: ours (``kernel``: the fused CPU kernels are loaded)
    decodes each code once for all rows of a call (SmolLM2's linear stack, one thread: 5.1 ms
    at 1 row, 8.7 at 4, 27 at 16, against aten's 6.9 / 11.5 / 43 and the dense 21.5 / 21.1
    / 31: benchmarks/int4_gemm.py); aten's otherwise. Only for weights that were 4-bit in
    the checkpoint: the codes are the file's own, nothing is quantized here.
    """

    def __init__(self, dense: nn.Module, weight: Int4Codes, group_size: int, max_rows: int,
                 dtype: torch.dtype, kernel: bool = False) -> None:
        super().__init__()
        self.dense = dense
        self.in_features = dense.in_features
        self.out_features = dense.out_features
        self.group_size = group_size
        self.max_rows = max_rows
        self.packed: PackedInt4 | None = None
        if kernel:
            self.packed = pack_int4(weight.codes, weight.scale, weight.zero)
        else:
            self.int4_weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                weight.codes.to(torch.int32).contiguous(), 1)
            # [K // group, N, 2]: aten's (scale, zero) layout, in the activation dtype.
            self.scale_zero = torch.stack([weight.scale.t(), weight.zero.t()],
                                          dim=-1).to(dtype).contiguous()
        self.bias = dense.bias
        self.weight_numel = getattr(dense, "weight_numel", self.in_features * self.out_features)

    def small_batch(self, flat: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return int4_linear(flat.contiguous(), self.packed)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.int4_weight,
                                                          self.group_size, self.scale_zero)

    def extra_repr(self) -> str:
        kernel = "hpu_serve" if self.packed is not None else "aten"
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"int4 ({kernel}) up to {self.max_rows} rows")


class SmallBatchQ8Linear(CodesLinear):
    """A packed dense linear plus the same weight as GGUF Q8_0 codes (int8, one scale per 32
    inputs), used for batches of up to ``max_rows`` rows by our kernel (csrc/q8_gemm.cpp):
    a GGUF's Q8_0 LM head, read as 32 MB of codes a step instead of a 57 MB bf16 copy
    (SmolLM2). Its rows, like the int4 kernel's, do not depend on the batch."""

    def __init__(self, dense: nn.Module, codes: torch.Tensor, scale: torch.Tensor,
                 max_rows: int) -> None:
        super().__init__()
        self.dense = dense
        self.in_features = dense.in_features
        self.out_features = dense.out_features
        self.max_rows = max_rows
        self.packed = pack_q8(codes, scale)
        self.bias = dense.bias
        self.weight_numel = getattr(dense, "weight_numel", self.in_features * self.out_features)

    def small_batch(self, flat: torch.Tensor) -> torch.Tensor:
        return q8_linear(flat.contiguous(), self.packed)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"Q8_0 (hpu_serve) up to {self.max_rows} rows")


def int4_supported(dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16 and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


def is_q8(weight: Int4Codes) -> bool:
    """GGUF Q8_0 codes (int8, ``w = codes * scale``) rather than 4-bit ones (uint8)."""
    return weight.codes.dtype == torch.int8


def attach_int4_weights(model: nn.Module, weights: Mapping[str, Int4Codes], max_rows: int,
                        dtype: torch.dtype, kernel: bool = False, q8_rows: int = 0) -> int:
    """Give each named linear of ``model`` its int4 codes for batches of up to ``max_rows``
    rows, run by our kernel if ``kernel`` else aten's, and a Q8_0 LM head its 8-bit codes
    for up to ``q8_rows`` (our kernel only; the caller leaves them out otherwise); returns
    how many got them (0 where aten's kernel or the dtype is missing)."""
    if not weights or not int4_supported(dtype):
        return 0
    for name, weight in weights.items():
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        dense = getattr(parent, attr)
        if tuple(weight.codes.shape) != (dense.out_features, dense.in_features):
            raise ValueError(f"{name}: codes {tuple(weight.codes.shape)} do not match "
                             f"the layer ({dense.out_features}, {dense.in_features})")
        if is_q8(weight):
            setattr(parent, attr, SmallBatchQ8Linear(dense, weight.codes, weight.scale,
                                                     q8_rows))
            logger.info("%s: the checkpoint's Q8_0 codes for batches of up to %d rows "
                        "(hpu_serve Q8_0 kernel)", name, q8_rows)
            continue
        group_size = weight.codes.shape[1] // weight.scale.shape[1]
        setattr(parent, attr, SmallBatchInt4Linear(dense, weight, group_size, max_rows, dtype,
                                                   kernel))
    int4 = sum(not is_q8(w) for w in weights.values())
    logger.info("%d linear layers also hold their checkpoint's 4-bit weights, used for "
                "batches of up to %d rows (%s int4 kernel)", int4, max_rows,
                "hpu_serve" if kernel else "aten")
    return len(weights)
