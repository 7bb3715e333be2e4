"""DeepSeek-V2 / V3's settings, read from their Hugging Face configs: multi-head latent
attention (MLA), the routed + shared experts and their router, the MTP layers."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from server.models.moe_routing import GroupScore, RouterSettings, Scoring


@dataclass(frozen=True, slots=True)
class MLASettings:
    """Multi-head latent attention. Keys and values of every head are expanded from one
    per-token latent of ``kv_lora_rank`` (plus one RoPE key of ``qk_rope_head_dim``
    shared by the heads): that latent and RoPE key are what the KV cache holds. Queries
    come from ``hidden`` directly (``q_lora_rank`` None) or through a low-rank pair."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    softmax_scale: float  # 1/sqrt(qk head dim), times YaRN's mscale(all dims) squared
    # the checkpoint's q / k RoPE dims come in interleaved pairs (V2 always, V3 where
    # rope_interleave): the loader de-interleaves those weight rows once
    rope_interleaved: bool

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_dim(self) -> int:
        """Values one token leaves in one layer's cache."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def deepseek_settings(hf: Any, v3: bool, rope_scaling: dict[str, Any] | None
                      ) -> dict[str, Any]:
    """The ModelConfig fields of a DeepSeek config (``v3``: V3's router and RoPE layout)."""
    qk_head_dim = hf.qk_nope_head_dim + hf.qk_rope_head_dim
    scale = qk_head_dim ** -0.5
    if rope_scaling is not None and rope_scaling.get("mscale_all_dim"):
        m = _yarn_mscale(float(rope_scaling["factor"]), float(rope_scaling["mscale_all_dim"]))
        scale *= m * m
    mla = MLASettings(
        q_lora_rank=getattr(hf, "q_lora_rank", None) or None,
        kv_lora_rank=int(hf.kv_lora_rank),
        qk_nope_head_dim=int(hf.qk_nope_head_dim),
        qk_rope_head_dim=int(hf.qk_rope_head_dim),
        v_head_dim=int(hf.v_head_dim),
        softmax_scale=scale,
        rope_interleaved=bool(getattr(hf, "rope_interleave", True)) if v3 else True,
    )
    groups = int(getattr(hf, "n_group", None) or 1)
    topk_groups = int(getattr(hf, "topk_group", None) or 1)
    if v3:
        router = RouterSettings(Scoring.SIGMOID, groups, topk_groups, GroupScore.TOP2_SUM,
                                float(hf.routed_scaling_factor), score_bias=True)
    else:  # V2: greedy over all experts, or its best groups first
        grouped = getattr(hf, "topk_method", "greedy") == "group_limited_greedy"
        router = RouterSettings(Scoring.SOFTMAX, groups if grouped else 1,
                                topk_groups if grouped else 1, GroupScore.MAX,
                                float(hf.routed_scaling_factor))
    mtp = getattr(hf, "num_nextn_predict_layers", None)
    if mtp is None:
        mtp = getattr(hf, "num_mtp_layers", 0)
    return dict(
        mla=mla,
        # the rotary tables span the RoPE part of the heads only
        head_dim=mla.qk_rope_head_dim,
        moe_router=router,
        num_shared_experts=int(getattr(hf, "n_shared_experts", None) or 0),
        # transformers' V2 router never renormalises, whatever norm_topk_prob says
        norm_topk_prob=bool(getattr(hf, "norm_topk_prob", False)) if v3 else False,
        mtp_layers=int(mtp or 0),
    )


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0
