"""The GGUF header of the frontier families, as llama.cpp's converter writes them:
"deepseek2" (DeepSeek-V2 and V3: latent attention, grouped routing, shared experts) and
"gpt-oss" (sinks, alternating windows, biased experts with the clamped SwiGLU) and
"qwen3next" (Gated DeltaNet layers beside gated full attention, routed plus shared
experts).

Each reader returns the ModelConfig fields that replace the Llama readings of gguf.py, from
the same keys and values llama.cpp reads; where llama.cpp fixes a value in its code instead
of the file (gpt-oss's SwiGLU limit, DeepSeek's RoPE layout), the fixed value is used here
too.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Protocol

from server.models.config import LinearAttentionSpec
from server.models.deepseek_config import deepseek_settings

# gguf's ExpertGatingFuncType: how the router scores experts
_GATING_SOFTMAX = 1
_GATING_SIGMOID = 2
# llama.cpp's converter writes DeepSeek's yarn_log_multiplier as 0.1 * mscale_all_dim
_DEEPSEEK_LOG_MUL = 0.1
# gpt-oss as llama.cpp runs it: every other layer windowed, the first one included (its
# swa pattern 2), the SwiGLU clamped at 7 with the sigmoid's alpha 1.702 (both fixed in
# llama.cpp, as in the released config)
_GPT_OSS_PATTERN = 2
_GPT_OSS_SWIGLU = (7.0, 1.702)


class Header(Protocol):
    """gguf.py's reader of a file's metadata (keys under ``{arch}.`` by call)."""

    def __call__(self, key: str, default: Any = None) -> Any: ...

    def values(self, key: str) -> list[Any] | None: ...


def _yarn(h: Header) -> dict[str, Any] | None:
    """YaRN as the converter writes it (``rope.scaling.type`` yarn, its factor, original
    context and betas), as a Hugging Face ``rope_scaling`` dict; None for other types."""
    factor = h("rope.scaling.factor")
    if h("rope.scaling.type") != "yarn" or not factor:
        return None
    scaling: dict[str, Any] = dict(
        rope_type="yarn", factor=float(factor),
        original_max_position_embeddings=int(h("rope.scaling.original_context_length")
                                              or h("context_length")))
    for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
        if h(f"rope.scaling.{key}") is not None:
            scaling[name] = float(h(f"rope.scaling.{key}"))
    return scaling


def deepseek2_fields(h: Header, fields: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek-V2 / V3 from a "deepseek2" header. The converter writes the attention as
    multi-query over the latent (``head_count_kv`` 1, ``key_length`` the latent plus the
    RoPE key), the per-head sizes in ``key_length_mla`` / ``value_length_mla`` (older files:
    ``key_length`` / ``value_length`` are the per-head ones). The router's gating function
    tells V3 (sigmoid, with the correction bias ``exp_probs_b``) from V2 (softmax; files
    without the key are V2, as llama.cpp assumes). llama.cpp rotates q/k in interleaved
    pairs, the checkpoints' own layout: the loader de-interleaves those rows as it does for
    safetensors."""
    rope_dim = int(h("rope.dimension_count"))
    kv_rank = int(h("attention.kv_lora_rank"))
    if h("attention.key_length_mla") is not None:
        qk_head = int(h("attention.key_length_mla"))
        v_head = int(h("attention.value_length_mla"))
    else:
        qk_head, v_head = int(h("attention.key_length")), int(h("attention.value_length"))
    v3 = int(h("expert_gating_func", _GATING_SOFTMAX)) == _GATING_SIGMOID
    groups = int(h("expert_group_count") or 1)
    mtp = int(h("nextn_predict_layers") or 0)
    hf = SimpleNamespace(
        q_lora_rank=h("attention.q_lora_rank"), kv_lora_rank=kv_rank,
        qk_nope_head_dim=qk_head - rope_dim, qk_rope_head_dim=rope_dim, v_head_dim=v_head,
        n_group=groups, topk_group=int(h("expert_group_used_count") or 1),
        topk_method="group_limited_greedy" if groups > 1 else "greedy",
        routed_scaling_factor=float(h("expert_weights_scale") or 1.0),
        n_shared_experts=int(h("expert_shared_count") or 0),
        norm_topk_prob=bool(h("expert_weights_norm") or False),
        rope_interleave=True, num_nextn_predict_layers=mtp)
    rope_scaling = _yarn(h)
    if rope_scaling is not None:
        # llama.cpp scales the scores by mscale(all dims) squared and leaves the RoPE
        # tables unscaled (its YaRN attention factor cancels): mscale == mscale_all_dim
        # in transformers' terms, as in the released configs
        rope_scaling["attention_factor"] = 1.0
        if h("rope.scaling.yarn_log_multiplier"):
            rope_scaling["mscale_all_dim"] = (float(h("rope.scaling.yarn_log_multiplier"))
                                              / _DEEPSEEK_LOG_MUL)
    num_layers = fields["num_layers"] - mtp
    return dict(
        deepseek_settings(hf, v3, rope_scaling),
        model_type="deepseek_v3" if v3 else "deepseek_v2",
        # the file's MTP layers (if any) follow the decoder's; the loader skips them
        num_layers=num_layers,
        moe_layers=tuple(i for i in fields["moe_layers"] if i < num_layers),
        num_kv_heads=fields["num_heads"],
        rotary_dim=None,
        rope_scaling=rope_scaling,
    )


def gpt_oss_fields(h: Header, fields: dict[str, Any]) -> dict[str, Any]:
    """gpt-oss from a "gpt-oss" header: the window on the layers of an explicit
    ``attention.sliding_window_pattern`` where the file has one, else on every other layer
    from the first; YaRN without truncated correction dims (the released config's
    ``truncate: false``)."""
    flags = h.values("attention.sliding_window_pattern")
    layers = range(fields["num_layers"])
    if flags is not None and len(flags) == fields["num_layers"]:
        windowed = tuple(i for i in layers if flags[i])
    else:
        pattern = int(flags[0]) if flags else _GPT_OSS_PATTERN
        windowed = tuple(i for i in layers if i % pattern < pattern - 1)
    rope_scaling = _yarn(h)
    if rope_scaling is not None:
        rope_scaling["truncate"] = False
    limit, alpha = _GPT_OSS_SWIGLU
    return dict(
        sliding_layers=windowed if fields["sliding_window"] else None,
        rope_scaling=rope_scaling,
        attn_sinks=True, moe_bias=True, swiglu_limit=limit, swiglu_alpha=alpha,
    )


def qwen3next_fields(h: Header, fields: dict[str, Any], names: set[str]) -> dict[str, Any]:
    """Qwen3-Next from a "qwen3next" header: the delta rule's sizes in the ``ssm.*`` keys
    (key heads as the group count, value heads as the time-step rank, the key head size as
    the state size, all value heads' width as the inner size), the linear layers those with
    an ``ssm_a`` tensor; the shared expert's width; the full attention's output gate (its
    q rows hold it, as in the checkpoint). The file keeps q/k/v and z apart: the layers
    read them as split projections (gguf_tensors.py)."""
    value_heads = int(h("ssm.time_step_rank"))
    return dict(
        linear_layers=tuple(i for i in range(fields["num_layers"])
                            if f"blk.{i}.ssm_a" in names),
        linear_attention=LinearAttentionSpec(
            num_key_heads=int(h("ssm.group_count")), num_value_heads=value_heads,
            key_head_dim=int(h("ssm.state_size")),
            value_head_dim=int(h("ssm.inner_size")) // value_heads,
            conv_kernel=int(h("ssm.conv_kernel")), split_projections=True),
        shared_expert_intermediate_size=int(h("expert_shared_feed_forward_length") or 0),
        attn_output_gate=True,
        qk_norm=any(n.endswith(".attn_q_norm.weight") for n in names),
    )
