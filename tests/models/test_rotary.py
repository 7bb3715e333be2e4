"""RoPE scaling variants: our cos/sin tables against transformers' rotary embeddings."""

from __future__ import annotations

import pytest
import torch
import transformers

from server.models.config import ModelConfig
from server.models.rotary import RotaryEmbedding

HEAD_DIM, MAX_POS = 32, 512


def hf_tables(config, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cls = {"phi3": transformers.models.phi3.modeling_phi3.Phi3RotaryEmbedding,
           "llama": transformers.models.llama.modeling_llama.LlamaRotaryEmbedding}
    rotary = cls[config.model_type](config)
    x = torch.zeros(1, len(positions), HEAD_DIM)
    cos, sin = rotary(x, positions.unsqueeze(0))
    return cos[0], sin[0]


def ours(config, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = ModelConfig.from_hf(config)
    rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                             cfg.rope_scaling)
    cos, sin = rotary(positions, torch.float32)
    return cos[:, 0], sin[:, 0]


def llama_config(rope: dict | None) -> transformers.LlamaConfig:
    extra = {"rope_scaling": rope} if rope else {}
    return transformers.LlamaConfig(hidden_size=128, num_attention_heads=4, vocab_size=64,
                                    max_position_embeddings=MAX_POS, rope_theta=10000.0,
                                    **extra)


@pytest.mark.parametrize("rope", [
    None,
    dict(rope_type="linear", factor=4.0),
    dict(rope_type="dynamic", factor=4.0),
    dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=128),
    dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=64, beta_fast=16.0,
         beta_slow=2.0, attention_factor=1.3),
    dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
         original_max_position_embeddings=64),
], ids=["default", "linear", "dynamic-ntk", "yarn", "yarn-explicit", "llama3"])
def test_tables_match_transformers(rope: dict | None) -> None:
    config = llama_config(rope)
    positions = torch.arange(MAX_POS)
    for a, b in zip(ours(config, positions), hf_tables(config, positions)):
        # float32 tables: positions x frequencies round differently at large positions
        torch.testing.assert_close(a, b, atol=5e-5, rtol=1e-5)


def test_longrope_short_factors_within_the_original_context_long_beyond() -> None:
    half = HEAD_DIM // 2
    config = transformers.Phi3Config(
        hidden_size=128, num_attention_heads=4, vocab_size=64, pad_token_id=0,
        max_position_embeddings=MAX_POS, original_max_position_embeddings=64,
        rope_scaling=dict(rope_type="longrope", short_factor=[1.0 + i / half for i in range(half)],
                          long_factor=[2.0 + 3 * i / half for i in range(half)]))
    short, long = torch.arange(64), torch.arange(64, MAX_POS)
    # transformers picks the long factors once a sequence outgrows the original context
    for a, b in zip(ours(config, short), hf_tables(config, short)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    hf_long = hf_tables(config, torch.arange(MAX_POS))
    for a, b in zip(ours(config, long), hf_long):
        torch.testing.assert_close(a, b[64:], atol=5e-5, rtol=1e-5)


def test_unknown_variant_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unsupported rope scaling type 'mrope'"):
        RotaryEmbedding(HEAD_DIM, 16, 10000.0, {"rope_type": "mrope"})
