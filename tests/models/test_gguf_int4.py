"""A GGUF's 4-bit weights (Q4_0, Q4_1, Q4_K) read as codes + (scale, zero): exactly the
values llama.cpp's own dequantization gives, row for row with the fused, un-permuted dense
weights, and served by the int4 kernel for small batches."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf_files import (
    HF_LAYER_NAMES,
    quantize_q4_k,
    random_k_quant,
    random_q4_k,
    write_gguf,
)

from server.models.gguf import GROUP_SIZE, read_int4_weights, split_blocks
from server.models.loader import _gguf_reader, load_model, resolve_model_source


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_block_split_matches_gguf_dequantize(kind: str) -> None:
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    rng = np.random.default_rng(0)
    weights = (rng.standard_normal((6, 4 * GROUP_SIZE)) * 0.1 + 0.03).astype(np.float32)
    raw = gguf.quants.quantize(weights, qtype)
    codes, scale, zero = split_blocks(raw, kind)
    assert_codes_equal_dequantize(codes, scale, zero, raw, qtype, weights.shape)


def assert_codes_equal_dequantize(codes, scale, zero, raw, qtype, shape) -> None:
    import gguf

    assert codes.shape == shape and codes.dtype == np.uint8
    assert codes.max() <= 15
    assert scale.shape == zero.shape == (shape[0], shape[1] // GROUP_SIZE)
    ours = (codes.astype(np.float32) - 8) * np.repeat(scale, GROUP_SIZE, 1) \
        + np.repeat(zero, GROUP_SIZE, 1)
    # float32 rounding only: the zero folds 8 * scale in (llama.cpp rounds once, we twice)
    np.testing.assert_allclose(ours, gguf.quants.dequantize(raw, qtype), rtol=0, atol=1e-6)


@pytest.mark.parametrize("blocks", ["random", "quantized"])
def test_q4_k_sub_blocks_are_int4_groups_of_32(blocks: str) -> None:
    """Q4_K's 8 sub-blocks per 256 values, with 6-bit scales and mins packed in 12 bytes,
    as group-32 codes: every byte pattern (random blocks, d / dmin random too), and blocks
    quantized from real weights."""
    import gguf

    rng = np.random.default_rng(0)
    weights = (rng.standard_normal((6, 3 * 256)) * 0.05).astype(np.float32)
    if blocks == "random":
        raw, qtype = random_q4_k(weights)
        raw = raw.reshape(6, 3, 144)
        raw[..., 0:4] = rng.uniform(-0.01, 0.01, (6, 3, 2)).astype(np.float16).view(np.uint8)
        raw = raw.reshape(6, -1)
    else:
        raw, qtype = quantize_q4_k(weights)
        assert np.abs(gguf.quants.dequantize(raw, qtype) - weights).max() < 0.02
    codes, scale, zero = split_blocks(raw, "Q4_K")
    assert_codes_equal_dequantize(codes, scale, zero, raw, qtype, weights.shape)



@pytest.mark.parametrize("kind", ["Q4_1", "Q4_K"])
def test_bf16_scales_cost_no_more_than_a_bf16_copy(kind: str) -> None:
    """The int4 kernel takes (scale, zero) in the activations' dtype: in bf16, the codes'
    weights stay within 1.5x the error of the dense bf16 copy of gguf's dequantization
    (measured on 2048 x 2048 N(0, 0.02) weights: max 3.0e-4 Q4_1, 2.9e-4 Q4_K vs 2.4e-4)."""
    import gguf

    x = (np.random.default_rng(0).standard_normal((512, 1024)) * 0.02).astype(np.float32)
    if kind == "Q4_K":
        raw, qtype = quantize_q4_k(x)
    else:
        qtype = gguf.GGMLQuantizationType.Q4_1
        raw = gguf.quants.quantize(x, qtype)
    exact = torch.from_numpy(gguf.quants.dequantize(raw, qtype))
    codes, scale, zero = (torch.from_numpy(a) for a in split_blocks(raw, kind))
    bf16 = lambda t: t.bfloat16().float().repeat_interleave(GROUP_SIZE, 1)  # noqa: E731
    int4 = (codes.float() - 8) * bf16(scale) + bf16(zero)
    dense = exact.bfloat16().float()
    assert (int4 - exact).abs().max() <= 1.5 * (dense - exact).abs().max()


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


def unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's Q/K row permutation (gguf_files.permute)."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, -1).transpose(1, 2).reshape(w.shape)


def test_q4_k_gguf_served_end_to_end_from_its_codes(tmp_path: Path) -> None:
    """A Llama GGUF whose linear weights are all Q4_K (quantized from a tiny random model,
    Q/K rows permuted as llama.cpp does): every layer keeps its file's codes, they equal the
    dequantized weights, and the engine, decoding small batches through the int4 kernel in
    bf16, gives the greedy tokens of transformers on gguf's dequantization (fp32)."""
    import gguf
    import transformers
    # tests/conftest.py by path: in a whole-suite run the name "conftest" may be another
    # directory's
    spec = importlib.util.spec_from_file_location(
        "root_conftest", Path(__file__).resolve().parents[1] / "conftest.py")
    assert spec is not None and spec.loader is not None
    root_conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(root_conftest)
    build_tokenizer = root_conftest.build_tokenizer

    from server.engine.llm import LLM
    from server.engine.sampling_params import SamplingParams
    from server.hpu.cpu.linear import SmallBatchInt4Linear, int4_supported

    if not int4_supported(torch.bfloat16):
        pytest.skip("no int4 CPU kernel in this torch build")
    tokenizer = build_tokenizer()
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    hf_model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # decisive logits: greedy tokens are not coin flips
        for p in hf_model.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    path = tmp_path / "tiny-llama-Q4_K.gguf"
    write_gguf(path, hf_model, "llama", quantize=quantize_q4_k, tokenizer=tokenizer)

    reference = copy.deepcopy(hf_model)
    inverse = HF_LAYER_NAMES
    state = reference.state_dict()
    quantized = 0
    with torch.no_grad():
        for t in gguf.GGUFReader(str(path)).tensors:
            if t.tensor_type != gguf.GGMLQuantizationType.Q4_K:
                continue
            _, layer, part, _ = t.name.split(".")
            values = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())
            heads = {"attn_q": 4, "attn_k": 2}.get(part)
            state[f"model.layers.{layer}.{inverse[part]}.weight"].copy_(
                values if heads is None else unpermute(values, heads))
            quantized += 1
    assert quantized == 7 * config.num_hidden_layers

    source = resolve_model_source(str(path))
    dense = load_model(source, "float32", torch.device("cpu"))
    codes = read_int4_weights(_gguf_reader(source), dense.config)
    assert len(codes) == 4 * config.num_hidden_layers  # qkv, o, gate_up, down per layer
    for name, weight in codes.items():
        torch.testing.assert_close(weight.dequantize(),
                                   dense.model.get_submodule(name).weight.data,
                                   rtol=0, atol=1e-6)

    llm = LLM(str(path), max_num_seqs=4, max_model_len=128)  # GGUF: bf16 by default
    layers = [m for m in llm.engine.runner.model.modules()
              if isinstance(m, SmallBatchInt4Linear)]
    assert len(layers) == 4 * config.num_hidden_layers
    # the layer loop, whose modules the hooks see (the one-call decode stack makes the same
    # kernel calls: tests/hpu/cpu/test_decode_stack.py)
    llm.engine.runner.model.decode_stack = None
    int4_calls = []
    for layer in layers:
        layer.register_forward_pre_hook(lambda mod, args: int4_calls.append(
            args[0].numel() // mod.in_features <= mod.max_rows))
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, len(tokenizer), (n,), generator=gen).tolist() for n in (9, 14)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    assert sum(int4_calls) >= 9 * len(layers)  # the decode steps ran the int4 kernel
    for prompt, output in zip(prompts, outputs):
        with torch.no_grad():
            want = reference.generate(torch.tensor([prompt]), max_new_tokens=10,
                                      do_sample=False, eos_token_id=None, pad_token_id=0)
        assert list(output.outputs[0].token_ids) == want[0, len(prompt):].tolist()


def test_a_layer_with_a_shard_in_another_type_keeps_no_codes(tmp_path: Path, caplog) -> None:
    """Q4_K everywhere but the down projections (Q6_K, as llama.cpp's Q4_K_M mixes do):
    those layers run dequantized only, and the load log counts them as such."""
    import logging

    import transformers

    from server.models.loader import load_int4_weights

    config = transformers.Qwen2Config(vocab_size=320, hidden_size=256, intermediate_size=512,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf_model = transformers.Qwen2ForCausalLM(config).eval()
    q6_k = random_k_quant("Q6_K")
    write_gguf(tmp_path / "mixed.gguf", hf_model, "qwen2", quantize=lambda a: (
        q6_k(a) if a.shape == (256, 512) else quantize_q4_k(a)))  # down_proj: [H, I]
    source = resolve_model_source(str(tmp_path / "mixed.gguf"))
    cfg = load_model(source, "float32", torch.device("cpu")).config
    with caplog.at_level(logging.INFO, logger="server.models.loader"):
        codes = load_int4_weights(source, cfg)
    assert sorted(codes) == sorted(f"layers.{i}.{m}" for i in range(2) for m in (
        "self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj"))
    assert "dequantized copy only: 2 Q6_K tensors" in caplog.text
    assert "No exact kernel here for Q6_K" in caplog.text


@pytest.mark.parametrize("arch", ["phi3", "gemma2", "llama-mixtral"])
def test_codes_line_up_with_each_familys_dense_weights(tiny_model_factory, tmp_path: Path,
                                                       arch: str) -> None:
    """Q4_0 files of the other layouts: Phi-3's fused attn_qkv and gate+up ffn_up (one
    shard each), Gemma 2, Mixtral's permuted Q/K (its experts stay dense: no codes)."""
    from gguf_files import gguf_quantizer
    from test_gguf_families import gemma2

    if arch == "phi3":
        hf_model = tiny_model_factory(model_type="phi3", tie=False, num_kv_heads=2)[1]
    elif arch == "gemma2":
        hf_model = gemma2()
    else:
        hf_model = tiny_model_factory(model_type="mixtral", tie=False, num_kv_heads=2)[1]
    path = tmp_path / f"{arch}-Q4_0.gguf"
    write_gguf(path, hf_model, arch.split("-")[0], quantize=gguf_quantizer("Q4_0"))
    source = resolve_model_source(str(path))
    dense = load_model(source, "float32", torch.device("cpu"))
    codes = read_int4_weights(_gguf_reader(source), dense.config)
    modules = ["self_attn.qkv_proj", "self_attn.o_proj"]
    if arch != "llama-mixtral":
        modules += ["mlp.gate_up_proj", "mlp.down_proj"]
    assert sorted(codes) == sorted(f"layers.{i}.{m}" for i in range(2) for m in modules)
    for name, weight in codes.items():
        torch.testing.assert_close(weight.dequantize(),
                                   dense.model.get_submodule(name).weight.data,
                                   rtol=0, atol=1e-6)
