"""The supported architectures, keyed by what checkpoints call them: ``config.architectures``
in a Hugging Face folder, ``general.architecture`` in a GGUF file.

Each entry says how its family departs from the Llama decoder (which every family here builds
on), so adding a family is one entry plus whatever new building block it needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Architecture:
    """One decoder family and its departures from the Llama layout."""

    name: str  # the Hugging Face class name in config.json's "architectures"
    model_type: str  # config.json's "model_type"
    gguf_name: str | None  # llama.cpp's general.architecture, when it exports the family
    qkv_bias: bool = False  # q/k/v projections always carry biases (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm of queries and keys before RoPE (Qwen3)
    # llama.cpp permutes Q/K rows (its interleaved RoPE) for these on export
    gguf_permuted_qk: bool = True
    # sparse mixture-of-experts MLPs (server/models/moe.py) in the layers the config marks
    moe: bool = False
    # the top-k routing weights are always renormalised to sum to 1 (Mixtral); otherwise
    # the config's norm_topk_prob decides (Qwen3-MoE)
    moe_renormalize: bool = False
    # Gemma 2 / 3: (1 + w) norms, a norm after each sublayer too, GeGLU, embeddings scaled
    # by sqrt(hidden), soft-capped attention scores and logits where the config sets caps
    gemma: bool = False
    # DeepSeek-V2 / V3: multi-head latent attention (server/models/mla.py), whose KV cache
    # holds a compressed latent; routed plus shared experts, grouped top-k routing
    mla: bool = False
    # gpt-oss: attention sinks, biased router and experts with a clamped SwiGLU, MXFP4
    # experts in its checkpoints (server/models/gpt_oss.py); layer_types window every other
    # layer
    gpt_oss: bool = False
    # Llama 4 (server/models/llama4.py): chunked local attention in the RoPE layers, layers
    # without RoPE (their queries temperature-tuned by position), weightless L2 q/k norms,
    # MoE layers with a shared expert and sigmoid routing, interleaved with dense MLPs
    llama4: bool = False
    # a conditional-generation checkpoint served as its text model: the config's
    # text_config, the weights under language_model. (the vision tower is ignored)
    text_part: bool = False
    # Qwen3-Next: Gated DeltaNet (linear attention, a per-sequence state) in the layers
    # config.json marks "linear_attention", gated full attention in the others, a shared
    # expert beside the routed ones, zero-centred (1 + w) norms (server/models/qwen3_next.py)
    hybrid: bool = False
    # Qwen3.5: the linear layers' q/k/v, z, b and a come from separate projections
    # (Qwen3-Next's are two, rows grouped per key head)
    split_delta_projections: bool = False


ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (
    Architecture("LlamaForCausalLM", "llama", "llama"),
    Architecture("MistralForCausalLM", "mistral", "mistral"),
    Architecture("Qwen2ForCausalLM", "qwen2", "qwen2", qkv_bias=True, gguf_permuted_qk=False),
    # Qwen2.5-VL's language model: Qwen2 with M-RoPE (its rope_parameters' mrope_section);
    # its vision tower is server/models/vision/qwen2_5_vl.py
    Architecture("Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl_text", None, qkv_bias=True,
                 gguf_permuted_qk=False),
    Architecture("Qwen3ForCausalLM", "qwen3", "qwen3", qk_norm=True, gguf_permuted_qk=False),
    # Granite's multipliers (embedding, residual, attention, logits) are config values
    Architecture("GraniteForCausalLM", "granite", "granite"),
    # Phi-3 / Phi-4: q/k/v and gate/up already fused in the checkpoint, LongRoPE
    Architecture("Phi3ForCausalLM", "phi3", "phi3", gguf_permuted_qk=False),
    Architecture("Gemma2ForCausalLM", "gemma2", "gemma2", gemma=True, gguf_permuted_qk=False),
    # Gemma 3 (text): Gemma 2 plus (1 + w) q/k norms, no soft caps by default, and its
    # sliding layers' own RoPE (config.py reads layer_types and the two RoPE settings)
    Architecture("Gemma3ForCausalLM", "gemma3_text", "gemma3", qk_norm=True, gemma=True,
                 gguf_permuted_qk=False),
    # llama.cpp exports Mixtral as "llama" with expert tensors (gguf_architecture tells them
    # apart by the expert count)
    Architecture("MixtralForCausalLM", "mixtral", "llama", moe=True, moe_renormalize=True),
    Architecture("Qwen3MoeForCausalLM", "qwen3_moe", "qwen3moe", qk_norm=True, moe=True,
                 gguf_permuted_qk=False),
    # llama.cpp exports both as "deepseek2" (its q/k rows as they are); the header's gating
    # function tells them apart (gguf_families.py), the V3 entry answers for the name
    Architecture("DeepseekV2ForCausalLM", "deepseek_v2", None, moe=True, mla=True,
                 gguf_permuted_qk=False),
    Architecture("DeepseekV3ForCausalLM", "deepseek_v3", "deepseek2", moe=True, mla=True,
                 gguf_permuted_qk=False),
    Architecture("GptOssForCausalLM", "gpt_oss", "gpt-oss", moe=True, moe_renormalize=True,
                 gguf_permuted_qk=False, gpt_oss=True),
    # llama.cpp's converter keeps Llama 4's (interleaved-RoPE) q/k rows as they are
    Architecture("Llama4ForCausalLM", "llama4_text", "llama4", gguf_permuted_qk=False, moe=True,
                 llama4=True),
    Architecture("Llama4ForConditionalGeneration", "llama4", None, gguf_permuted_qk=False,
                 moe=True, llama4=True, text_part=True),
    # llama.cpp's "qwen3next" (its q/k rows as they are); its "qwen35" / "qwen35moe" files
    # are not read (no GGUF name below: refused as unsupported)
    Architecture("Qwen3NextForCausalLM", "qwen3_next", "qwen3next", qk_norm=True, moe=True,
                 hybrid=True, gguf_permuted_qk=False),
    # Qwen3.5's text models: Qwen3-Next's layers (text positions make its M-RoPE plain
    # RoPE), dense MLPs, or experts with a shared expert and always renormalised top-k
    Architecture("Qwen3_5ForCausalLM", "qwen3_5_text", None, qk_norm=True, hybrid=True,
                 split_delta_projections=True),
    Architecture("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text", None, qk_norm=True, moe=True,
                 moe_renormalize=True, hybrid=True, split_delta_projections=True),
)}


def served_as_text(architectures: Sequence[str] | None) -> bool:
    """A conditional-generation checkpoint this registry serves as its text model (Llama 4):
    its config reads the text part itself, and no vision tower is built for it."""
    return any(a in ARCHITECTURES and ARCHITECTURES[a].text_part for a in architectures or ())


def supported() -> str:
    return ", ".join(sorted(ARCHITECTURES))


def architecture_of(architectures: Sequence[str] | None, model_type: str | None) -> Architecture:
    """The family of a Hugging Face config; a clear error naming the supported ones."""
    for name in architectures or ():
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    if not architectures:  # hand-written configs may name only the model type
        for arch in ARCHITECTURES.values():
            if arch.model_type == model_type:
                return arch
    given = ", ".join(architectures or ()) or f"model_type {model_type!r}"
    raise ValueError(f"unsupported architecture {given}; supported: {supported()}")


def gguf_architecture(name: str, moe: bool = False) -> Architecture:
    """The family of a GGUF file's ``general.architecture``; ``moe``: the file has expert
    tensors (one llama.cpp name can cover a dense and a mixture-of-experts family)."""
    matches = [a for a in ARCHITECTURES.values() if a.gguf_name == name]
    for arch in matches:
        if arch.moe == moe:
            return arch
    if matches:
        kind = "mixture-of-experts" if moe else "dense"
        raise ValueError(f"GGUF architecture {name!r} is not supported as a {kind} model")
    known = ", ".join(sorted({a.gguf_name for a in ARCHITECTURES.values() if a.gguf_name}))
    raise ValueError(f"unsupported GGUF architecture {name!r}; supported: {known}")
