"""gpt-oss (``GptOssForCausalLM``) checkpoints onto the Llama-family decoder of llama.py.

The model is the Llama decoder with four departures, all switched on by the config
(``ModelConfig.from_hf`` reads them, registry.py marks the family):

- attention sinks: ``self_attn.sinks [Hq]``, one logit per query head in every softmax's
  denominator (every attention path takes them, server/hpu/attention.py and the fused CPU
  kernels);
- sliding windows on every other layer (``layer_types``), q/k/v/o biases;
- a sparse MLP in every layer (moe.py) whose router has a bias and takes the softmax of the
  top-k logits (the renormalised top-k of the full softmax), whose experts have biases and
  the clamped SwiGLU;
- MXFP4 experts in the released checkpoints (dequantized at load, quantized.py).

This module maps the checkpoint's tensors onto the loader's canonical names and layouts,
whole tensors at a time (before tensor-parallel slicing):

- ``mlp.router.{weight,bias}`` -> ``mlp.gate.{weight,bias}``;
- ``mlp.experts.gate_up_proj``: transformers keeps it ``[E, H, 2I]`` (input-major) with
  gate and up *interleaved* along the last axis (gate = ``[..., ::2]``); MXFP4 files hold it
  ``[E, 2I, H]`` (output-major, the same interleaving). Both become the canonical stacked
  ``[E, 2I, H]``, gate rows then up rows (moe.py);
- ``mlp.experts.down_proj``: ``[E, I, H]`` in transformers, ``[E, H, I]`` in MXFP4 files ->
  the canonical ``[E, H, I]``;
- the expert biases ``gate_up_proj_bias [E, 2I]`` (interleaved) and ``down_proj_bias
  [E, H]`` -> moe.py's ``mlp.b_gate_up`` (gate then up) and ``mlp.b_down``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch

_EXPERTS = re.compile(r"(.*\.mlp)\.experts\.(gate_up_proj|down_proj)(_bias)?$")


def gpt_oss_tensors(tensors: Iterator[tuple[str, torch.Tensor]], dequantized: bool
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors under the loader's names and layouts (module docstring);
    ``dequantized``: the experts come from MXFP4 blocks (output-major), not transformers'
    input-major parameters."""
    for name, tensor in tensors:
        name = name.replace(".mlp.router.", ".mlp.gate.")
        match = _EXPERTS.match(name)
        if match is None:
            yield name, tensor
            continue
        prefix, proj, bias = match.groups()
        if bias:
            if proj == "gate_up_proj":
                yield f"{prefix}.b_gate_up", _gate_then_up(tensor, dim=1)
            else:
                yield f"{prefix}.b_down", tensor
            continue
        if not dequantized:  # transformers' [E, in, out] -> [E, out, in]
            tensor = tensor.transpose(1, 2)
        if proj == "gate_up_proj":
            tensor = _gate_then_up(tensor, dim=1)
        yield f"{prefix}.experts.{proj}", tensor


def _gate_then_up(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    """Interleaved gate/up entries along ``dim`` (gate at even indices) -> gate half, then
    up half."""
    pairs = tensor.unflatten(dim, (-1, 2))
    return torch.cat([pairs.select(dim + 1, 0), pairs.select(dim + 1, 1)], dim=dim)
