"""A GGUF's 4-bit weights read as codes + (scale, zero): exactly the values llama.cpp's
own dequantization gives, row for row with the fused, un-permuted dense weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from server.models.gguf import GROUP_SIZE, split_blocks, read_int4_weights
from server.models.loader import _gguf_reader, load_model, resolve_model_source


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_block_split_matches_gguf_dequantize(kind: str) -> None:
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    rng = np.random.default_rng(0)
    weights = (rng.standard_normal((6, 4 * GROUP_SIZE)) * 0.1 + 0.03).astype(np.float32)
    raw = gguf.quants.quantize(weights, qtype)
    codes, scale, zero = split_blocks(raw, kind)
    assert codes.shape == weights.shape
    assert codes.max() <= 15
    assert scale.shape == zero.shape == (6, 4)
    ours = (codes.astype(np.float32) - 8) * np.repeat(scale, GROUP_SIZE, 1) \
        + np.repeat(zero, GROUP_SIZE, 1)
    np.testing.assert_allclose(ours, gguf.quants.dequantize(raw, qtype), rtol=0, atol=1e-6)


@pytest.mark.slow
def test_embedded_model_codes_equal_its_dequantized_weights() -> None:
    source = resolve_model_source(None)
    loaded = load_model(source, "float32", torch.device("cpu"))
    weights = read_int4_weights(_gguf_reader(source), loaded.config)
    # SmolLM2's Q4_1 file: all 4 fused linears of all 30 layers are 4-bit (the head is Q8_0)
    assert len(weights) == 4 * loaded.config.num_layers
    for name, weight in weights.items():
        dense = loaded.model.get_submodule(name).weight
        assert weight.codes.dtype == torch.uint8
        assert int(weight.codes.max()) <= 15
        torch.testing.assert_close(weight.dequantize(), dense, rtol=0, atol=1e-6)
