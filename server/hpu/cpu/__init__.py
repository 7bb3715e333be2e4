"""The CPU backend: everything that makes eager serving on a CPU fast, in one place.

- ``platform.py``: the ``cpu`` platform (KV cache bound by ``VLLM_CPU_KVCACHE_SPACE``,
  eager by default, gloo for tensor parallelism);
- ``linear.py``: linear weights packed in oneDNN's blocked layout, a copy for our bf16
  small-batch kernel (``bf16_pack.py``), and a checkpoint's own 4-bit codes for small
  decode batches (``int4_pack.py``: their layout for our kernel);
- ``kernels.py`` and ``csrc/``: fused C++ kernels, built once per machine;
- ``layer_ops.py``: the layer ops that call them;
- ``host_memory.py``: allocator tuning for step temporaries.

``prepare_model`` is the one entry point that readies a loaded model for eager CPU serving.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from server.hpu.cpu.bf16_pack import bf16_kernel_available
from server.hpu.cpu.int4_pack import int4_kernel_available
from server.hpu.cpu.kernels import load_cpu_kernels
from server.hpu.cpu.layer_ops import FusedCpuLayerOps
from server.hpu.cpu.linear import (
    Int4Codes,
    attach_int4_weights,
    bf16_max_rows,
    int4_max_rows,
    int4_supported,
    is_q8,
    pack_linear_layers,
    q8_max_rows,
)
from server.hpu.cpu.q8_pack import q8_kernel_available
from server.hpu.layer_ops import TorchLayerOps

logger = logging.getLogger(__name__)


def prepare_model(model: torch.nn.Module, *, use_kernels: bool,
                  int4_weights: Callable[[], Mapping[str, Int4Codes]] | None,
                  cache_dir: Path, decode_query: int = 1) -> TorchLayerOps:
    """oneDNN-packed linears; the checkpoint's 4-bit weights for small decode batches (when
    ``int4_weights`` is given and the dtype allows; ``decode_query``: tokens per sequence
    of the largest decode step, a speculative verify's k + 1); the fused kernels unless
    ``use_kernels`` is false or they cannot be built. Returns the layer ops to run."""
    dtype = next(model.parameters()).dtype
    kernels = (dtype in FusedCpuLayerOps.dtypes and use_kernels
               and load_cpu_kernels(cache_dir / "kernels"))
    codes = int4_weights() if int4_weights is not None and int4_supported(dtype) else {}
    ours = bool(kernels) and int4_kernel_available()
    if not (kernels and q8_kernel_available()):  # Q8_0 codes: our kernel or none
        codes = {name: w for name, w in codes.items() if not is_q8(w)}
    small_rows = bf16_max_rows(decode_query) if kernels and bf16_kernel_available() else 0
    pack_linear_layers(model, small_rows, head_rows=bf16_max_rows(decode_query, head=True))
    if codes:
        attach_int4_weights(model, codes, int4_max_rows(decode_query, ours, small_rows > 0),
                            dtype, ours, q8_max_rows(decode_query))
    if dtype not in FusedCpuLayerOps.dtypes:
        logger.info("Fused CPU kernels serve float32 / bfloat16 only: %s runs PyTorch ops",
                    str(dtype).replace("torch.", ""))
        return TorchLayerOps()
    if not kernels:
        return TorchLayerOps()
    logger.info("Layer ops: fused CPU kernels (decode attention reads KV blocks in place)")
    return FusedCpuLayerOps()
