"""The GGUF path on a file written here: llama.cpp's layout (permuted Q/K, rope_freqs for
Llama 3.1 scaling) must load into the same logits transformers computes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf_files import HF_LAYER_NAMES, gguf_quantizer, write_gguf

from server.models.loader import load_model, resolve_model_source

SCALING = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
               original_max_position_embeddings=64)


def test_gguf_with_permuted_qk_and_rope_freqs_matches_transformers(tiny_model_factory,
                                                                   tmp_path: Path) -> None:
    _, hf_model, _ = tiny_model_factory(tie=False, rope_scaling=SCALING)
    path = tmp_path / "tiny-llama31.gguf"
    write_gguf(path, hf_model, llama_scaling=SCALING)
    loaded = load_model(resolve_model_source(str(path)), "float32", torch.device("cpu"))
    assert not loaded.config.tie_word_embeddings
    assert loaded.config.num_kv_heads == 2
    ids = torch.randint(3, hf_model.config.vocab_size, (1, 200), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf_model(ids).logits[0]
    # position 199 is far beyond original_max_position_embeddings=64: scaling matters here
    torch.testing.assert_close(last_logits(loaded, ids[0].tolist()), ref[-1], atol=2e-4,
                               rtol=1e-4)


def assert_last_logits_match(loaded, hf_model, length: int) -> None:
    ids = torch.randint(3, hf_model.config.vocab_size, (1, length),
                        generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf_model(ids).logits[0]
    torch.testing.assert_close(last_logits(loaded, ids[0].tolist()), ref[-1], atol=2e-4,
                               rtol=1e-4)


def last_logits(loaded, prompt: list[int]) -> torch.Tensor:
    """Our logits at the prompt's last position, through a paged prefill."""
    from server.engine.core.block_manager import BlockManager
    from server.engine.core.sequence import Sequence
    from server.engine.sampling_params import SamplingParams
    from server.engine.worker.input_builder import InputBuilder
    from server.engine.worker.model_runner import ModelForward
    from server.hpu.kv_cache import allocate_kv_cache

    cfg = loaded.config
    bm = BlockManager(16, 16)
    kv = allocate_kv_cache(cfg.num_layers, 16, 16, cfg.num_kv_heads, cfg.head_dim,
                           torch.float32, torch.device("cpu"))
    forward = ModelForward(loaded.model, kv)
    inputs = InputBuilder(16, bm.pad_block_id, torch.device("cpu"), torch.float32, 4096)
    seq = Sequence(0, "r", 0, prompt, SamplingParams(), 0.0)
    bm.allocate(seq)
    with torch.inference_mode():
        return forward(inputs.prefill([seq]))[0]


def test_qwen3_gguf_matches_transformers(tiny_model_factory, tmp_path: Path) -> None:
    """Qwen3 as llama.cpp exports it: q/k norms, HF row order, head size != hidden / heads."""
    _, hf_model, _ = tiny_model_factory(model_type="qwen3", tie=False)
    path = tmp_path / "tiny-qwen3.gguf"
    write_gguf(path, hf_model, arch="qwen3")
    loaded = load_model(resolve_model_source(str(path)), "float32", torch.device("cpu"))
    assert loaded.config.qk_norm and loaded.config.head_dim == 32
    assert_last_logits_match(loaded, hf_model, length=40)


@pytest.mark.parametrize("kind", ["F16", "BF16", "Q8_0", "Q5_0", "Q5_1", "Q4_0", "Q4_1",
                                  "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_quantized_gguf_types_load_to_llama_cpp_values(tmp_path: Path, kind: str) -> None:
    """A Qwen2 GGUF (biases, Hugging Face row order) whose linear weights are stored in
    ``kind``: they load as gguf's own dequantization of the file, and the logits equal
    transformers' with those weights (K-quants need rows of 256: a 256-wide model)."""
    import copy

    import gguf
    import transformers

    config = transformers.Qwen2Config(vocab_size=320, hidden_size=256, intermediate_size=512,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=256,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    hf_model = transformers.Qwen2ForCausalLM(config).eval()
    path = tmp_path / f"tiny-qwen2-{kind}.gguf"
    write_gguf(path, hf_model, arch="qwen2", quantize=gguf_quantizer(kind))
    reader = gguf.GGUFReader(str(path))
    reference = copy.deepcopy(hf_model)
    inverse = HF_LAYER_NAMES
    state = reference.state_dict()
    quantized = 0
    with torch.no_grad():
        for t in reader.tensors:
            if t.tensor_type == gguf.GGMLQuantizationType[kind]:
                _, layer, part, _ = t.name.split(".")
                values = gguf.quants.dequantize(t.data, t.tensor_type)
                state[f"model.layers.{layer}.{inverse[part]}.weight"].copy_(
                    torch.from_numpy(values.copy()))
                quantized += 1
    assert quantized == 7 * config.num_hidden_layers
    loaded = load_model(resolve_model_source(str(path)), "float32", torch.device("cpu"))
    ours_down = loaded.model.layers[1].mlp.down_proj.weight
    torch.testing.assert_close(ours_down, state["model.layers.1.mlp.down_proj.weight"],
                               rtol=0, atol=0)
    ids = torch.randint(3, 320, (1, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = reference(ids).logits[0]
    torch.testing.assert_close(last_logits(loaded, ids[0].tolist()), ref[-1], atol=3e-4,
                               rtol=1e-4)


def test_granite_gguf_matches_transformers(tiny_model_factory, tmp_path: Path) -> None:
    """Granite as llama.cpp exports it: permuted Q/K rows, its multipliers as GGUF scales."""
    _, hf_model, _ = tiny_model_factory(model_type="granite", tie=False)
    path = tmp_path / "tiny-granite.gguf"
    write_gguf(path, hf_model, arch="granite")
    loaded = load_model(resolve_model_source(str(path)), "float32", torch.device("cpu"))
    assert loaded.config.residual_multiplier == pytest.approx(0.3)
    assert_last_logits_match(loaded, hf_model, length=40)


def test_a_load_parses_its_gguf_once_and_keeps_no_parse(tiny_model_factory, tmp_path: Path,
                                                         monkeypatch) -> None:
    """The engine's build reads a GGUF file's header for its sampling defaults, config,
    weights and codes from one parse, and drops it once built: a parse holds a numpy view
    per vocabulary entry, which a serving process would carry to its exit and walk in every
    full garbage collection."""
    import gc
    import weakref

    from server import LLM, SamplingParams
    from server.models import gguf as gguf_module

    _, hf_model, tokenizer = tiny_model_factory(tie=False)
    path = tmp_path / "tiny-llama.gguf"
    write_gguf(path, hf_model, tokenizer=tokenizer)
    parses: list[weakref.ref] = []
    parse = gguf_module._parse

    def counted(file: str):  # noqa: ANN202
        reader = parse(file)
        parses.append(weakref.ref(reader))
        return reader

    monkeypatch.setattr(gguf_module, "_parse", counted)
    llm = LLM(str(path), dtype="float32", max_num_seqs=2, max_model_len=64)
    assert len(parses) == 1
    gc.collect()
    assert parses[0]() is None
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
