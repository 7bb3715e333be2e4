"""Architecture hyper-parameters, read once from a Hugging Face config object."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from server.hpu.kv_cache import KVCacheLayout
from server.models.deepseek_config import MLASettings, deepseek_settings
from server.models.moe_routing import RouterSettings
from server.models.quantized import QuantConfig
from server.models.registry import architecture_of


@dataclass(frozen=True, slots=True)
class LinearAttentionSpec:
    """Sizes of a Gated DeltaNet layer (Qwen3-Next): each value head keeps a recurrent
    state ``[key_head_dim, value_head_dim]``, value heads share key heads in groups, and
    q, k, v pass a causal depthwise convolution of ``conv_kernel`` taps first."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    # q/k/v, z, b and a from separate projections (Qwen3.5); False: Qwen3-Next's two
    # projections, rows grouped per key head
    split_projections: bool = False

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """What the decoder needs to build itself; nothing about serving."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k, before RoPE
    # Granite's scalings (1.0 / None elsewhere): embeddings x, each sublayer's output x
    # before it joins the residual stream, the attention scale instead of 1/sqrt(head_dim),
    # logits divided by
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    # Sliding-window attention: a token sees the keys of the last sliding_window positions
    # (itself included) in the layers listed in sliding_layers, all layers when that is None
    # (Mistral, Phi-3); Gemma 2/3 interleave windowed and global layers.
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] | None = None
    # RoPE over the first rotary_dim dims of each head only (partial_rotary_factor < 1);
    # None: the whole head
    rotary_dim: int | None = None
    # M-RoPE (Qwen2.5-VL): the rotary frequencies in three sections, rotated by a token's
    # temporal, height and width positions (positions then come as [3, ...]); None: RoPE
    mrope_section: tuple[int, ...] | None = None
    # Gemma 3: the windowed layers' own RoPE (base and scaling), the global layers keep
    # rope_theta / rope_scaling
    local_rope_theta: float | None = None
    local_rope_scaling: dict[str, Any] | None = None
    # Gemma 2 (see registry.py): the MLP's activation, score and logit caps, a norm after
    # each sublayer, and the checkpoint's norm weights stored as (w - 1)
    mlp_act: str = "silu"  # or "gelu_tanh"
    attn_softcap: float | None = None
    final_softcap: float | None = None
    sandwich_norms: bool = False
    norm_offset: float = 0.0
    # Gemma rounds its embedding multiplier to the model dtype before scaling (sqrt(2560)
    # is 50.6 but 50.5 in bfloat16); Granite multiplies by the exact float
    embedding_multiplier_in_dtype: bool = False
    # how the checkpoint's linear weights are quantized (GPTQ, AWQ, FP8), None: they are not
    quant: QuantConfig | None = None
    # torch dtype name from the checkpoint ("bfloat16", "float32"...), None if unknown
    checkpoint_dtype: str | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Mixture of experts (Mixtral, Qwen3-MoE); num_experts == 0 for dense models. The layers
    # listed in moe_layers replace their MLP by num_experts experts of moe_intermediate_size,
    # num_experts_per_tok of them per token; the others keep a dense MLP of intermediate_size.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalise the top-k routing weights to sum to 1
    moe_layers: tuple[int, ...] = ()
    # how the router picks and weighs experts (DeepSeek's grouped, biased top-k), and
    # DeepSeek's shared experts: one MLP of num_shared_experts * moe_intermediate_size
    # that every token of a sparse layer goes through besides its routed experts
    moe_router: RouterSettings = RouterSettings()
    num_shared_experts: int = 0
    # DeepSeek-V2 / V3's multi-head latent attention (None: the usual heads); head_dim is
    # then the RoPE part of a head, which the rotary tables span
    mla: MLASettings | None = None
    # multi-token-prediction layers stored after the decoder's (DeepSeek-V3's
    # num_nextn_predict_layers): the loader skips their tensors, saying so
    mtp_layers: int = 0
    # gpt-oss (server/models/gpt_oss.py): a learned sink logit per attention head; biases on
    # the router and on every expert's projections; the experts' clamped SwiGLU,
    # (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with g = min(gate, limit)
    attn_sinks: bool = False
    moe_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    # Llama 4 (see llama4.py): the layers in chunked_layers attend within chunks of
    # attention_chunk_size positions only; those in nope_layers rotate nothing and, with
    # attn_temperature = (floor_scale, attn_scale), scale their queries up with position;
    # qk_l2_norm: a weightless RMS norm of each q and k head in the RoPE layers
    attention_chunk_size: int | None = None
    chunked_layers: tuple[int, ...] = ()
    nope_layers: tuple[int, ...] = ()
    qk_l2_norm: bool = False
    attn_temperature: tuple[float, float] | None = None
    # RoPE over interleaved pairs (Llama 4): q/k rows (weights, adapters) are reordered at
    # load into the rotate-half layout the RoPE kernels rotate (rotary.interleaved_to_halves)
    interleaved_rope: bool = False
    # what the checkpoint's weight names start with ("language_model." for the text model
    # of a conditional-generation checkpoint, whose other weights are ignored)
    checkpoint_prefix: str = ""
    # Hybrid models (Qwen3-Next): the linear-attention layers (no KV cache: a fixed-size
    # state per sequence instead), their sizes, the shared expert beside the routed ones,
    # and the sigmoid gate on the full-attention output (q_proj holds it after each head)
    linear_layers: tuple[int, ...] = ()
    linear_attention: LinearAttentionSpec | None = None
    shared_expert_intermediate_size: int = 0
    attn_output_gate: bool = False

    @classmethod
    def from_hf(cls, hf: Any) -> ModelConfig:
        arch = architecture_of(getattr(hf, "architectures", None),
                               getattr(hf, "model_type", None))
        outer = hf  # dtype and quantization are the whole checkpoint's
        if arch.text_part:
            hf = hf.get_text_config()
        model_type = hf.model_type if arch.text_part else arch.model_type
        num_heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
        partial = _partial_rotary_factor(hf)
        # as transformers sizes it: int(head_dim * factor), the frequencies over that size
        rotary_dim = int(head_dim * partial) if partial != 1.0 else None
        rope_theta, rope_scaling = _rope_settings(hf, "full_attention")
        local_theta, local_scaling = (_rope_settings(hf, "sliding_attention")
                                      if _has_local_rope(hf) else (None, None))
        attention_bias = bool(getattr(hf, "attention_bias", False))
        dtype = getattr(outer, "dtype", None) or getattr(outer, "torch_dtype", None)
        eos = getattr(hf, "eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        moe = _moe_settings(hf, arch.moe_renormalize) if arch.moe else {}
        gemma = _gemma_settings(hf) if arch.gemma else {}
        gpt_oss = _gpt_oss_settings(hf) if arch.gpt_oss else {}
        hybrid = _hybrid_settings(hf, arch.split_delta_projections) if arch.hybrid else {}
        fields: dict[str, Any] = dict(
            model_type=model_type,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            # Qwen3.5-MoE's text config has none: every layer is sparse
            intermediate_size=getattr(hf, "intermediate_size", None) or 0,
            num_layers=hf.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=hf.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases and no o bias; Llama's flag covers all four.
            qkv_bias=arch.qkv_bias or attention_bias,
            o_bias=attention_bias and not arch.qkv_bias,
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            qk_norm=arch.qk_norm,
            embedding_multiplier=float(getattr(hf, "embedding_multiplier", 1.0) or 1.0),
            residual_multiplier=float(getattr(hf, "residual_multiplier", 1.0) or 1.0),
            attention_multiplier=(float(hf.attention_multiplier)
                                  if getattr(hf, "attention_multiplier", None) else None),
            logits_scaling=float(getattr(hf, "logits_scaling", 1.0) or 1.0),
            **_window_settings(hf),
            rotary_dim=rotary_dim,
            mrope_section=_mrope_section(hf),
            local_rope_theta=local_theta,
            local_rope_scaling=local_scaling,
            quant=QuantConfig.from_hf(_as_dict(getattr(outer, "quantization_config", None))),
            checkpoint_dtype=str(dtype).replace("torch.", "") if dtype is not None else None,
            eos_token_ids=eos_ids,
        )
        fields.update(moe)
        fields.update(gemma)  # Gemma's readings replace the Llama ones
        if arch.mla:
            fields.update(deepseek_settings(hf, model_type == "deepseek_v3", rope_scaling))
        fields.update(gpt_oss)
        if arch.llama4:
            fields.update(_llama4_settings(hf))
        if arch.text_part:
            fields["checkpoint_prefix"] = "language_model."
        fields.update(hybrid)
        return cls(**fields)

    def layer_chunk(self, index: int) -> int | None:
        """The attention chunk of layer ``index``, None where it is not chunked."""
        return self.attention_chunk_size if index in self.chunked_layers else None

    @property
    def is_hybrid(self) -> bool:
        """Linear-attention layers with a per-sequence state beside the KV cache."""
        return self.linear_attention is not None

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The layers that keep keys and values in the paged cache."""
        return tuple(i for i in range(self.num_layers) if i not in self.linear_layers)

    @property
    def num_kv_layers(self) -> int:
        return self.num_layers - len(self.linear_layers)

    def layer_window(self, index: int) -> int | None:
        """The sliding window of layer ``index``, None where it attends to everything."""
        if self.sliding_window is None:
            return None
        if self.sliding_layers is None or index in self.sliding_layers:
            return self.sliding_window
        return None

    @property
    def min_window(self) -> int | None:
        """The smallest window of any layer (None: attention is global everywhere)."""
        windows = [w for i in range(self.num_layers) if (w := self.layer_window(i)) is not None]
        return min(windows, default=None)

    @property
    def uses_local_rope(self) -> bool:
        return self.local_rope_theta is not None

    @property
    def kv_layout(self) -> KVCacheLayout:
        """What each token leaves in each layer's KV cache: K and V heads, or MLA's
        latent and RoPE key, read as keys and values at once."""
        if self.mla is not None:
            return KVCacheLayout(self.num_kv_layers, 1, self.mla.cache_dim, shared_kv=True)
        # hybrid models: the linear-attention layers keep a state instead (state_cache.py)
        return KVCacheLayout(self.num_kv_layers, self.num_kv_heads, self.head_dim)


def _window_settings(hf: Any) -> dict[str, Any]:
    """sliding_window / sliding_layers as transformers applies them: the window in the
    layers ``layer_types`` marks "sliding_attention" (Gemma 2/3, Qwen2/3, whose configs
    drop the window unless use_sliding_window and mark the layers from max_window_layers
    on), or in every layer of families without layer types (Mistral, Mixtral, Phi-3)."""
    window = getattr(hf, "sliding_window", None) or None
    if window is None:
        return dict(sliding_window=None, sliding_layers=None)
    if getattr(hf, "use_bidirectional_attention", False):
        raise ValueError("bidirectional sliding-window attention is not supported")
    layer_types = getattr(hf, "layer_types", None)
    if layer_types is None:
        return dict(sliding_window=int(window), sliding_layers=None)
    layers = tuple(i for i, kind in enumerate(layer_types) if kind == "sliding_attention")
    if not layers:
        return dict(sliding_window=None, sliding_layers=None)
    return dict(sliding_window=int(window), sliding_layers=layers)


def _has_local_rope(hf: Any) -> bool:
    """Gemma 3 gives its sliding layers their own RoPE: a rope_parameters dict per layer
    type (transformers >= 5), or rope_local_base_freq in older config files."""
    params = getattr(hf, "rope_parameters", None)
    if isinstance(params, dict) and "sliding_attention" in params:
        return True
    return getattr(hf, "rope_local_base_freq", None) is not None


def _gemma_settings(hf: Any) -> dict[str, Any]:
    """Gemma 2 and 3's departures, as ModelConfig fields (they override the Llama readings)."""
    act = getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", "gelu_pytorch_tanh")
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"Gemma with activation {act!r} is not supported (gelu_pytorch_tanh)")
    return dict(
        mlp_act="gelu_tanh",
        embedding_multiplier=float(hf.hidden_size) ** 0.5,
        attention_multiplier=float(hf.query_pre_attn_scalar) ** -0.5,
        attn_softcap=getattr(hf, "attn_logit_softcapping", None) or None,
        final_softcap=getattr(hf, "final_logit_softcapping", None) or None,
        sandwich_norms=True,
        norm_offset=1.0,
        embedding_multiplier_in_dtype=True,
    )


def _gpt_oss_settings(hf: Any) -> dict[str, Any]:
    """gpt-oss's departures: sinks, biased router and experts, the clamped SwiGLU. Its
    router takes the softmax of the top-k logits, which is the renormalised top-k of the
    full softmax (the registry entry sets moe_renormalize)."""
    return dict(attn_sinks=True, moe_bias=True,
                swiglu_limit=float(getattr(hf, "swiglu_limit", 7.0)),
                swiglu_alpha=float(getattr(hf, "swiglu_alpha", 1.702)))


def _hybrid_settings(hf: Any, split_projections: bool) -> dict[str, Any]:
    """Qwen3-Next's departures: the layer kinds of ``layer_types`` (every
    ``full_attention_interval``-th layer full attention in older config files), the Gated
    DeltaNet sizes, the shared expert, the gated attention output."""
    layer_types = getattr(hf, "layer_types", None)
    if layer_types is None:
        interval = int(getattr(hf, "full_attention_interval", 4))
        layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                       for i in range(hf.num_hidden_layers)]
    unknown = sorted(set(layer_types) - {"full_attention", "linear_attention"})
    if unknown:
        raise ValueError(f"unsupported layer types {unknown} (full_attention, "
                         "linear_attention)")
    act = getattr(hf, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"Qwen3-Next with activation {act!r} is not supported (silu)")
    return dict(
        linear_layers=tuple(i for i, kind in enumerate(layer_types)
                            if kind == "linear_attention"),
        linear_attention=LinearAttentionSpec(
            num_key_heads=int(hf.linear_num_key_heads),
            num_value_heads=int(hf.linear_num_value_heads),
            key_head_dim=int(hf.linear_key_head_dim),
            value_head_dim=int(hf.linear_value_head_dim),
            conv_kernel=int(hf.linear_conv_kernel_dim),
            split_projections=split_projections),
        shared_expert_intermediate_size=int(
            getattr(hf, "shared_expert_intermediate_size", 0) or 0),
        attn_output_gate=True,
    )


def _moe_settings(hf: Any, always_renormalize: bool) -> dict[str, Any]:
    """The expert fields of ModelConfig. Mixtral names the expert count num_local_experts and
    sizes its experts with intermediate_size (every layer sparse); Qwen3-MoE says num_experts
    (transformers >= 5 maps it to num_local_experts), moe_intermediate_size, and keeps dense
    MLPs in mlp_only_layers and in the layers off every decoder_sparse_step-th."""
    experts = getattr(hf, "num_local_experts", None) or getattr(hf, "num_experts", None) or 0
    moe_size = getattr(hf, "moe_intermediate_size", None) or hf.intermediate_size
    dense_layers = set(getattr(hf, "mlp_only_layers", None) or ())
    step = getattr(hf, "decoder_sparse_step", None) or 1
    first_sparse = getattr(hf, "first_k_dense_replace", None) or 0  # DeepSeek
    layers = tuple(i for i in range(first_sparse, hf.num_hidden_layers)
                   if experts > 0 and i not in dense_layers and (i + 1) % step == 0)
    return dict(
        num_experts=int(experts),
        num_experts_per_tok=int(hf.num_experts_per_tok),
        moe_intermediate_size=int(moe_size),
        norm_topk_prob=always_renormalize or bool(getattr(hf, "norm_topk_prob", False)),
        moe_layers=layers,
    )


def _llama4_settings(hf: Any) -> dict[str, Any]:
    """Llama 4's departures. Its config names the sizes the other way round: the dense
    layers' MLP is intermediate_size_mlp wide, each expert (and the shared one)
    intermediate_size; no_rope_layers holds 1 for the layers that DO rotate."""
    if getattr(hf, "hidden_act", "silu") != "silu":
        raise ValueError(f"Llama 4 with activation {hf.hidden_act!r} is not supported (silu)")
    layers = range(hf.num_hidden_layers)
    rotates = list(hf.no_rope_layers)
    types = list(hf.layer_types)
    chunked = tuple(i for i in layers if types[i] == "chunked_attention")
    return dict(
        intermediate_size=int(hf.intermediate_size_mlp),
        moe_intermediate_size=int(hf.intermediate_size),
        num_experts=int(hf.num_local_experts),
        num_experts_per_tok=int(hf.num_experts_per_tok),
        norm_topk_prob=False,
        moe_layers=tuple(int(i) for i in hf.moe_layers),
        attention_chunk_size=int(hf.attention_chunk_size) if chunked else None,
        chunked_layers=chunked,
        nope_layers=tuple(i for i in layers if not rotates[i]),
        qk_l2_norm=bool(hf.use_qk_norm),
        interleaved_rope=True,
        attn_temperature=((float(hf.floor_scale), float(hf.attn_scale))
                          if hf.attn_temperature_tuning else None),
    )


def _rope_settings(hf: Any, layer_type: str = "full_attention"
                   ) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling dict or None) from either config generation.

    transformers >= 5 folds both into ``rope_parameters`` (one dict per layer type where
    they differ: Gemma 3); older configs (and config.json files written by them) carry
    ``rope_theta`` and ``rope_scaling`` (and Gemma 3 ``rope_local_base_freq``, unscaled).
    """
    params = getattr(hf, "rope_parameters", None)
    if isinstance(params, dict) and layer_type in params:
        params = params[layer_type]
    elif layer_type == "sliding_attention":
        return float(hf.rope_local_base_freq), None
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        rope_type = params.get("rope_type", params.get("type", "default"))
        scaling = None if rope_type == "default" else dict(params, rope_type=rope_type)
        return theta, _with_original_context(hf, scaling)
    theta = float(getattr(hf, "rope_theta", 10000.0))
    scaling = getattr(hf, "rope_scaling", None)
    if scaling:
        scaling = dict(scaling)
        scaling.setdefault("rope_type", scaling.get("type", "default"))
        if scaling["rope_type"] == "default":
            scaling = None
    return theta, _with_original_context(hf, scaling or None)


def _with_original_context(hf: Any, scaling: dict[str, Any] | None) -> dict[str, Any] | None:
    """Phi-3 keeps ``original_max_position_embeddings`` beside the scaling, not in it."""
    original = getattr(hf, "original_max_position_embeddings", None)
    if scaling is not None and original and "original_max_position_embeddings" not in scaling:
        scaling = dict(scaling, original_max_position_embeddings=original)
    return scaling


def _mrope_section(hf: Any) -> tuple[int, ...] | None:
    """M-RoPE's frequency sections (temporal, height, width), from either config
    generation."""
    params = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None)
    section = params.get("mrope_section") if isinstance(params, dict) else None
    if not section:
        return None
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    if sum(section) * 2 != head_dim or len(section) != 3:
        raise ValueError(f"mrope_section {list(section)} must be three sections covering "
                         f"half the head size {head_dim}")
    return tuple(int(s) for s in section)


def _partial_rotary_factor(hf: Any) -> float:
    params = getattr(hf, "rope_parameters", None)
    if isinstance(params, dict) and "partial_rotary_factor" in params:
        return float(params["partial_rotary_factor"] or 1.0)
    return float(getattr(hf, "partial_rotary_factor", 1.0) or 1.0)


def _as_dict(value: Any) -> dict[str, Any] | None:
    if value is None or isinstance(value, dict):
        return value
    return value.to_dict() if hasattr(value, "to_dict") else dict(vars(value))
