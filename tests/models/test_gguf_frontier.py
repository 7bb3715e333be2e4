"""GGUF files of the frontier families as llama.cpp's converter writes them ("deepseek2",
"gpt-oss", "qwen3next"), built here from tiny random transformers models: the config read from the
header equals the one read from the same model's config.json, and the logits and greedy
tokens are transformers' on the same weights (F32; gpt-oss's experts also as MXFP4 blocks
repacked from a checkpoint's own). One request of each family is served over HTTP from the
GGUF file alone (its tokenizer included)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf_frontier import (
    mxfp4_gguf_blocks,
    write_deepseek2_gguf,
    write_gpt_oss_gguf,
    write_qwen3next_gguf,
)
from test_gguf_families import assert_matches
from test_gpt_oss import CASE as GPT_OSS
from test_gpt_oss import _mxfp4_checkpoint
from test_qwen3_next import QWEN3_NEXT
from test_qwen3_next import assert_logits_match as assert_hybrid_matches

from server.models.errors import ModelFileError
from server.models.loader import load_model, load_model_config, resolve_model_source

# as the released DeepSeek configs: mscale == mscale_all_dim (llama.cpp's header has room
# for mscale_all_dim only, its YaRN assumes the two equal)
DEEPSEEK_YARN = dict(rope_type="yarn", rope_theta=10_000.0, factor=4.0,
                     original_max_position_embeddings=128, mscale=0.8, mscale_all_dim=0.8,
                     beta_fast=32, beta_slow=1)
V3 = dict(model_type="deepseek_v3", tie=False, rope_scaling=DEEPSEEK_YARN)
V2 = dict(model_type="deepseek_v2", tie=False, rope_scaling=DEEPSEEK_YARN)
# the fields the header does not carry (the EOS id is the vocabulary's, written with it
# only; the tiny config's MTP layer has no weights), or carries rounded to float32, or
# in llama.cpp's terms (YaRN: the RoPE tables are compared by the logits)
_NOT_IN_THE_HEADER = {"checkpoint_dtype", "eos_token_ids", "mtp_layers", "rms_norm_eps",
                      "rope_scaling", "mla", "linear_attention"}


def _folder(tmp_path: Path, name: str) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    return folder


def assert_same_config(hf_folder: str, gguf_folder: str) -> None:
    """Every ModelConfig field read from the GGUF header is the config.json's (float32
    rounding aside); the latent attention's sizes and softmax scale included."""
    ours = load_model_config(resolve_model_source(gguf_folder))
    ref = load_model_config(resolve_model_source(hf_folder))
    differ = [f.name for f in dataclasses.fields(ref) if f.name not in _NOT_IN_THE_HEADER
              and getattr(ours, f.name) != getattr(ref, f.name)]
    assert differ == []
    assert ours.rms_norm_eps == pytest.approx(ref.rms_norm_eps)
    if ref.mla is not None:
        assert dataclasses.replace(ours.mla, softmax_scale=0.0) == \
            dataclasses.replace(ref.mla, softmax_scale=0.0)
        assert ours.mla.softmax_scale == pytest.approx(ref.mla.softmax_scale)


# DeepSeek-V2 / V3 ("deepseek2")


@pytest.mark.parametrize("case,split", [(V3, True), (V3, False), (V2, True)],
                         ids=["v3-k_b-v_b", "v3-kv_b", "v2-k_b-v_b"])
def test_deepseek2_matches_transformers(tiny_model_factory, tmp_path, case: dict,
                                        split: bool) -> None:
    """Latent attention from kv_b_proj whole (older files) or split into the transposed
    attn_k_b and attn_v_b (newer ones), q through its low-rank pair (V3) or direct (V2),
    YaRN's mscale, grouped routing (sigmoid with the correction bias, or softmax), shared
    experts, the leading dense layer: transformers' logits and greedy tokens."""
    hf_folder, hf_model = tiny_model_factory(**case)[:2]
    folder = _folder(tmp_path, "deepseek2")
    write_deepseek2_gguf(folder / "tiny.gguf", hf_model, split_kv_b=split)
    assert_same_config(hf_folder, str(folder))
    assert_matches(str(folder), hf_model)


def test_deepseek2_k_b_without_v_b_is_a_clear_error(tiny_model_factory, tmp_path) -> None:
    folder = _folder(tmp_path, "cut")
    write_deepseek2_gguf(folder / "tiny.gguf", tiny_model_factory(**V3)[1],
                         skip="blk.2.attn_v_b.weight")
    with pytest.raises(ModelFileError, match=r"tiny\.gguf.*\(2, 'attn_k_b', 'weight'\)"):
        load_model(resolve_model_source(str(folder)), "float32", torch.device("cpu"))


# gpt-oss


def test_gpt_oss_matches_transformers(tiny_model_factory, tmp_path) -> None:
    """Sinks, the window on every other layer (8 tokens: prompts and decodes cross it),
    q/k/v/o biases, the biased router, the experts' split gate/up with their biases and the
    clamped SwiGLU, YaRN: transformers' logits and greedy tokens, F32 experts."""
    hf_folder, hf_model = tiny_model_factory(**GPT_OSS)[:2]
    folder = _folder(tmp_path, "gpt-oss")
    write_gpt_oss_gguf(folder / "tiny.gguf", hf_model)
    assert_same_config(hf_folder, str(folder))
    cfg = load_model_config(resolve_model_source(str(folder)))
    assert cfg.sliding_layers == (0,) and cfg.attn_sinks and cfg.swiglu_limit == 7.0
    assert_matches(str(folder), hf_model)


def test_gpt_oss_mxfp4_experts_match_transformers(tmp_path) -> None:
    """A checkpoint's MXFP4 experts repacked into ggml's MXFP4 blocks, as llama.cpp's
    converter does: dequantized at load to transformers' own dequantization of the
    checkpoint's bytes."""
    import gguf
    from safetensors.torch import load_file

    from tests.conftest import save_tiny_model

    hf_model = save_tiny_model(tmp_path / "bf", **GPT_OSS)[0]
    _mxfp4_checkpoint(hf_model, tmp_path / "bf", tmp_path / "mx")
    packed = {n: t for n, t in load_file(tmp_path / "mx" / "model.safetensors").items()
              if n.endswith(("_blocks", "_scales"))}
    folder = _folder(tmp_path, "gguf")
    write_gpt_oss_gguf(folder / "tiny.gguf", hf_model, mxfp4=packed)
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(str(folder / "tiny.gguf")).tensors}
    assert types["blk.1.ffn_up_exps.weight"] == gguf.GGMLQuantizationType.MXFP4
    assert sum(t == gguf.GGMLQuantizationType.MXFP4 for t in types.values()) == 6
    assert_matches(str(folder), hf_model)


def test_mxfp4_blocks_dequantize_by_the_format() -> None:
    """ggml's MXFP4 block read by hand from the format: one scale byte (a power of two
    biased by 127), 16 bytes of e2m1 codes (element j low nibble, j + 16 high); the gguf
    package's dequantization gives those values, and the blocks repacked from a checkpoint's
    layout give the checkpoint's own dequantization."""
    import gguf

    from server.models.quantized import E2M1, mxfp4_dequantize

    codes = np.array([(i * 7) % 16 for i in range(32)], dtype=np.uint8)
    block = np.concatenate([[129], codes[:16] | (codes[16:] << 4)]).astype(np.uint8)
    by_hand = np.array([E2M1[c] * 4.0 for c in codes], dtype=np.float32)  # 2^(129 - 127)
    got = gguf.quants.dequantize(block[None], gguf.GGMLQuantizationType.MXFP4)
    np.testing.assert_array_equal(got[0], by_hand)

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(110, 140, (3, 10, 4), generator=gen, dtype=torch.uint8)
    repacked = mxfp4_gguf_blocks(blocks, scales)
    theirs = gguf.quants.dequantize(repacked, gguf.GGMLQuantizationType.MXFP4)
    np.testing.assert_array_equal(theirs, mxfp4_dequantize(blocks, scales).numpy())


# Qwen3-Next ("qwen3next")


def test_qwen3next_matches_transformers(tiny_model_factory, tmp_path) -> None:
    """Gated DeltaNet layers from llama.cpp's regrouped q/k/v and z, b and a still grouped
    per key head, -exp(A_log), squeezed convolution taps, (1 + w) norms; gated full
    attention with partial RoPE; routed plus gated shared experts: transformers' logits
    over a 70-token prompt (two chunks of the delta rule) and decode steps on the states."""
    hf_folder, hf_model = tiny_model_factory(**QWEN3_NEXT)[:2]
    folder = _folder(tmp_path, "qwen3next")
    write_qwen3next_gguf(folder / "tiny.gguf", hf_model)
    assert_same_config(hf_folder, str(folder))
    ours = load_model_config(resolve_model_source(str(folder))).linear_attention
    ref = load_model_config(resolve_model_source(hf_folder)).linear_attention
    # the file keeps q/k/v and z apart: read as split projections, the sizes the same
    assert ours == dataclasses.replace(ref, split_projections=True)
    assert_hybrid_matches(str(folder), hf_model)


# over HTTP, from the GGUF file alone


@pytest.mark.slow  # a server process each
@pytest.mark.parametrize("family", ["deepseek2", "gpt-oss", "qwen3next"])
def test_served_from_the_gguf_file(tiny_model_factory, tmp_path, family: str) -> None:
    """The file with its vocabulary (transformers reads no deepseek2 config: the tokenizer
    comes from the vocabulary alone) serves a completion whose greedy text, detokenized by
    the file's vocabulary, is transformers' on the same weights."""
    import openai
    from server_process import MODEL_NAME, TINY_FLAGS, start_server
    from test_sliding_window import hf_greedy

    case, write = {"deepseek2": (V3, write_deepseek2_gguf),
                   "gpt-oss": (GPT_OSS, write_gpt_oss_gguf),
                   "qwen3next": (QWEN3_NEXT, write_qwen3next_gguf)}[family]
    _, hf_model, tokenizer = tiny_model_factory(**case)
    path = _folder(tmp_path, family) / "tiny.gguf"
    write(path, hf_model, tokenizer=tokenizer)
    ids = tokenizer("hello world, the quick brown fox")["input_ids"]
    expected = tokenizer.decode(hf_greedy(hf_model, ids, 10), skip_special_tokens=True)
    server = start_server(str(path), *TINY_FLAGS)
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
        done = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=10,
                                         temperature=0, extra_body={"ignore_eos": True})
    finally:
        server.stop()
    assert done.choices[0].text == expected
