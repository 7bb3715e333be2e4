"""A GGUF file's tensors under Hugging Face names, dequantized, in the layout the loader
expects (un-permuted Q/K rows, experts stacked gate-then-up).

One name map serves both the dequantized weights and the 4-bit codes (gguf_quants.py), so a
module's codes line up with its dense weight row for row.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import torch
from tqdm import tqdm

from server.models.config import ModelConfig
from server.models.errors import model_file_error
from server.models.registry import ARCHITECTURES

# Pseudo-name under which the rope_freqs tensor (Llama 3.1's RoPE scaling) is yielded.
ROPE_FREQ_FACTORS = "rotary.freq_factors"

_TOP_LEVEL_NAMES = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": ROPE_FREQ_FACTORS,
}
# llama.cpp's per-block tensor -> the Hugging Face module (under layers.N)
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",  # Phi-3: fused in the checkpoint already
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    # mixture of experts: the router, then all experts of a layer stacked [E, out, in]
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_gate_up_exps": "mlp.experts.gate_up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "exp_probs_b": "mlp.e_score_correction_bias",  # DeepSeek-V3's router bias
    "attn_sinks": "self_attn.sinks",  # gpt-oss
}
# Tensors that are a parameter of ours rather than a module's weight or bias, or a module's
# weight under another name: (llama.cpp part, kind) -> our name under layers.N
_PARAMETER_NAMES = {
    ("ffn_gate_up_exps", "weight"): "mlp.experts.gate_up_proj",
    ("ffn_down_exps", "weight"): "mlp.experts.down_proj",
    ("ffn_down_exps", "bias"): "mlp.b_down",  # gpt-oss's expert biases
    ("exp_probs_b", "bias"): "mlp.e_score_correction_bias",
    ("attn_sinks", "weight"): "self_attn.sinks",
    ("ssm_a", ""): "linear_attn.A_log",  # Qwen3-Next: stored as -exp(A_log), no suffix
    ("ssm_dt", "bias"): "linear_attn.dt_bias",
}
# Two llama.cpp tensors that make one of ours, joined once both were read: (first part,
# kind) -> (second part, our name under layers.N)
_JOINED = {
    # experts [E, I, H] each -> gate rows then up rows; gpt-oss's biases [E, I] likewise
    ("ffn_gate_exps", "weight"): ("ffn_up_exps", "mlp.experts.gate_up_proj"),
    ("ffn_gate_exps", "bias"): ("ffn_up_exps", "mlp.b_gate_up"),
    # DeepSeek's kv_b_proj as newer converters split it for llama.cpp's absorbed attention
    ("attn_k_b", "weight"): ("attn_v_b", "self_attn.kv_b_proj.weight"),
}
_SECOND = {(second, kind): first for (first, kind), (second, _) in _JOINED.items()}
# Gemma 2 / 3's four norms: llama.cpp's ffn_norm is the pre-MLP norm, and the
# post-attention norm (applied to the attention output) has a name of its own
_GEMMA_NORMS = {"ffn_norm": "pre_feedforward_layernorm",
                "post_attention_norm": "post_attention_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}
# DeepSeek's latent attention (its kv_b_proj whole in older files, split in newer ones) and
# shared experts
_DEEPSEEK = {
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "attn_k_b": "self_attn.k_b_proj",
    "attn_v_b": "self_attn.v_b_proj",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
# Qwen3-Next: the Gated DeltaNet layers as llama.cpp keeps them, q/k/v (rows q, k, v of
# all heads) and z apart as Qwen3.5's projections are (the config says split projections);
# b and a still grouped per key head in ssm_ba (split in _hybrid_pieces)
_QWEN3_NEXT = {
    "post_attention_norm": "post_attention_layernorm",
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_ba": "linear_attn.in_proj_ba",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
    "ssm_a": "linear_attn.A_log",
    "ssm_dt": "linear_attn.dt_bias",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# the zero-centred (1 + w) norms, which llama.cpp's converter stores as 1 + w
_QWEN3_NEXT_NORMS = ("attn_norm", "post_attention_norm", "attn_q_norm", "attn_k_norm")
# Where a family's converter reuses a name for another module
_FAMILY_BLOCK_NAMES = {
    "gemma2": _GEMMA_NORMS,
    "gemma3_text": _GEMMA_NORMS,
    # Phi-3's ffn_up is the checkpoint's gate_up_proj: gate rows then up rows
    "phi3": {"ffn_up": "mlp.gate_up_proj"},
    # Llama 4's shared expert
    "llama4_text": {"ffn_gate_shexp": "mlp.shared_expert.gate_proj",
                    "ffn_up_shexp": "mlp.shared_expert.up_proj",
                    "ffn_down_shexp": "mlp.shared_expert.down_proj"},
    "deepseek_v2": _DEEPSEEK,
    "deepseek_v3": _DEEPSEEK,
    # gpt-oss's pre-MLP norm
    "gpt_oss": {"post_attention_norm": "post_attention_layernorm"},
    "qwen3_next": _QWEN3_NEXT,
}
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)(?:\.(weight|bias))?$")


def block_names(cfg: ModelConfig) -> dict[str, str]:
    return {**_BLOCK_NAMES, **_FAMILY_BLOCK_NAMES.get(cfg.model_type, {})}


def parse_block_tensor(name: str, names: dict[str, str]) -> tuple[int, str, str, str] | None:
    """``blk.3.attn_q.weight`` -> (3, "attn_q", HF module, "weight"); the kind is "" for a
    tensor without suffix (``blk.3.ssm_a``); None for others."""
    match = _BLOCK_TENSOR.match(name)
    if match is None or match.group(2) not in names:
        return None
    layer, part, kind = match.groups()
    return int(layer), part, names[part], kind or ""


def _unpermutes(cfg: ModelConfig) -> bool:
    # llama.cpp's converter permutes Q/K rows for its interleaved RoPE on "llama" models
    # only (Mixtral included); the others keep the Hugging Face layout.
    return next(a.gguf_permuted_qk for a in ARCHITECTURES.values()
                if a.model_type == cfg.model_type)


def unpermute(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (rows only; any trailing shape)."""
    rows = t.shape[0]
    return (t.reshape(num_heads, rows // num_heads // 2, 2, *t.shape[1:])
            .transpose(1, 2).reshape(t.shape))


def q_or_k_heads(part: str, cfg: ModelConfig) -> int | None:
    """The head count to un-permute a tensor's rows by, None if it is not permuted."""
    if not _unpermutes(cfg):
        return None
    return {"attn_q": cfg.num_heads, "attn_k": cfg.num_kv_heads}.get(part)


def dequantized_tensors(reader: Any, cfg: ModelConfig, meta: bool = False,
                        origin: dict[str, str] | None = None
                        ) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, float32 tensor) for every tensor the model uses.

    Experts come as transformers 5 holds them: ``mlp.experts.gate_up_proj [E, 2I, H]``
    (llama.cpp stores gate and up apart, joined here once both were read) and
    ``mlp.experts.down_proj [E, H, I]``.

    ``meta``: shapes only (meta tensors, nothing read), for checking the file against the
    config before the model is allocated; ``origin`` collects each yielded name's GGUF
    tensor, for error messages.
    """
    import gguf

    names = block_names(cfg)
    pending: dict[tuple[int, str, str], torch.Tensor] = {}  # one of a pair (_JOINED)
    # disable=None: no bar unless stderr is a terminal (a log file or pipeline gets none)
    tensors = reader.tensors if meta else tqdm(reader.tensors, desc="Dequantizing GGUF",
                                               unit="tensor", leave=False, disable=None)
    for t in tensors:
        parsed = parse_block_tensor(t.name, names)
        if parsed is not None:
            layer, part, module, kind = parsed
            name = f"layers.{layer}.{module}.{kind}"
        elif t.name in _TOP_LEVEL_NAMES:
            layer, part, name, kind = -1, "", _TOP_LEVEL_NAMES[t.name], "weight"
        else:
            continue  # e.g. Phi-3's rope_factors_*: read into the config
        if meta:  # GGUF lists dims innermost first
            weights = torch.empty([int(d) for d in reversed(t.shape)], device="meta")
        else:
            weights = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())
        heads = q_or_k_heads(part, cfg)
        if heads is not None and kind == "weight":
            weights = unpermute(weights, heads)
        if (part, kind) in _PARAMETER_NAMES:
            name = f"layers.{layer}.{_PARAMETER_NAMES[(part, kind)]}"
        first = part if (part, kind) in _JOINED else _SECOND.get((part, kind))
        if first is not None:
            second, joined = _JOINED[(first, kind)]
            other = pending.pop((layer, second if part == first else first, kind), None)
            if other is None:
                pending[(layer, part, kind)] = weights
                continue
            weights = _join(first, *((weights, other) if part == first else (other, weights)))
            name = f"layers.{layer}.{joined}"
        for name, weights in (_hybrid_pieces(part, name, weights, cfg) if cfg.is_hybrid
                              else [(name, weights)]):
            if origin is not None:
                origin[name] = t.name
            yield name, weights
    if pending:
        path = getattr(getattr(reader, "data", None), "filename", None) or "GGUF file"
        raise model_file_error(path, "tensors without the other of their pair (gate or up "
                               f"of experts, k_b or v_b): {sorted(pending)}")


def _join(first: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A _JOINED pair as one tensor. DeepSeek's ``attn_k_b [H, r, dn]`` (stored transposed
    for llama.cpp's absorbed attention) and ``attn_v_b [H, dv, r]`` -> ``kv_b_proj [H * (dn +
    dv), r]``, each head's key rows then value rows; the others stacked along dim 1 (gate
    then up)."""
    if first == "attn_k_b":
        return torch.cat([a.transpose(1, 2), b], dim=1).flatten(0, 1)
    return torch.cat([a, b], dim=1)


def _hybrid_pieces(part: str, name: str, weights: torch.Tensor, cfg: ModelConfig
                   ) -> list[tuple[str, torch.Tensor]]:
    """A Qwen3-Next tensor as llama.cpp's converter changed it, back in the checkpoint's
    terms: ``ssm_a`` holds ``-exp(A_log)``; the convolution taps ``[C, K]`` lost the
    checkpoint's middle axis; the zero-centred norms hold ``1 + w`` (all but the delta
    rule's own gated norm); ``ssm_ba``'s rows are each key head's b rows then its a rows,
    split into ``in_proj_b`` / ``in_proj_a`` (value heads in order)."""
    if part == "ssm_a":
        return [(name, torch.log(-weights))]
    if part == "ssm_conv1d":
        return [(name, weights.unsqueeze(1))]
    if part in _QWEN3_NEXT_NORMS or name == "norm.weight":
        return [(name, weights - 1)]
    if part == "ssm_ba":
        assert cfg.linear_attention is not None
        b, a = weights.view(cfg.linear_attention.num_key_heads, 2, -1,
                            weights.shape[-1]).unbind(1)
        prefix = name.removesuffix("in_proj_ba.weight")
        return [(f"{prefix}in_proj_b.weight", b.flatten(0, 1)),
                (f"{prefix}in_proj_a.weight", a.flatten(0, 1))]
    return [(name, weights)]
