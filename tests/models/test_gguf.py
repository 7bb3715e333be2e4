"""The GGUF path on a file written here: llama.cpp's layout (permuted Q/K, rope_freqs for
Llama 3.1 scaling) must load into the same logits transformers computes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from server.models.loader import load_model, resolve_model_source
from server.models.rotary import rope_inv_freq

SCALING = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
               original_max_position_embeddings=64)


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's conversion of HF Q/K rows to its interleaved RoPE layout."""
    return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def write_gguf(path: Path, hf_model, arch: str = "llama", quantize=None) -> None:
    """As llama.cpp's converter lays the file out: "llama" with permuted Q/K rows and
    rope_freqs (Llama 3.1 scaling), "granite" permuted with its four scales, "qwen2" /
    "qwen3" in the HF row order (q/k norms, head size as the key length)."""
    import gguf

    cfg = hf_model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    llama = arch in ("llama", "granite")  # llama.cpp permutes Q/K rows for both
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    if arch == "granite":
        writer.add_rope_dimension_count(head_dim)
        writer.add_embedding_scale(cfg.embedding_multiplier)
        writer.add_residual_scale(cfg.residual_multiplier)
        writer.add_attention_scale(cfg.attention_multiplier)
        writer.add_logit_scale(cfg.logits_scaling)
    elif llama:
        writer.add_rope_dimension_count(head_dim)
        base = rope_inv_freq(head_dim, float(cfg.rope_parameters["rope_theta"]), None)
        scaled = rope_inv_freq(head_dim, float(cfg.rope_parameters["rope_theta"]), SCALING)
        writer.add_tensor("rope_freqs.weight", (base / scaled).numpy().astype(np.float32))
    else:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    names = {"embed_tokens": "token_embd", "norm": "output_norm"}
    parts = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
    for name, tensor in hf_model.state_dict().items():
        array = tensor.float().numpy()
        if name == "lm_head.weight":
            gguf_name = "output.weight"
        elif name.startswith("model.layers."):
            _, _, layer, rest = name.split(".", 3)
            part, kind = rest.rsplit(".", 1)
            gguf_name = f"blk.{layer}.{parts[part]}.{kind}"
            if not llama or kind != "weight":
                pass
            elif part == "self_attn.q_proj":
                array = permute(array, cfg.num_attention_heads)
            elif part == "self_attn.k_proj":
                array = permute(array, cfg.num_key_value_heads)
        else:
            gguf_name = names[name.split(".")[1]] + ".weight"
        if quantize is not None and array.ndim == 2 and name.startswith("model.layers."):
            raw, qtype = quantize(np.ascontiguousarray(array))
            writer.add_tensor(gguf_name, raw, raw_dtype=qtype)
            continue
        writer.add_tensor(gguf_name, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_with_permuted_qk_and_rope_freqs_matches_transformers(tiny_model_factory,
                                                                   tmp_path: Path) -> None:
    _, hf_model, _ = tiny_model_factory(tie=False, rope_scaling=SCALING)
    path = tmp_path / "tiny-llama31.gguf"
    write_gguf(path, hf_model)
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
    from server.engine.block_manager import BlockManager
    from server.engine.input_builder import InputBuilder
    from server.engine.model_runner import ModelForward
    from server.engine.sampling_params import SamplingParams
    from server.engine.sequence import Sequence
    from server.hpu.kv_cache import allocate_kv_cache

    cfg = loaded.config
    bm = BlockManager(16, 16)
    kv = allocate_kv_cache(cfg.num_layers, 16, 16, cfg.num_kv_heads, cfg.head_dim,
                           torch.float32, torch.device("cpu"))
    forward = ModelForward(loaded.model, kv)
    inputs = InputBuilder(16, bm.pad_block_id, torch.device("cpu"), torch.float32)
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


def random_q4_k(array: np.ndarray):
    """Q4_K blocks (256 values: fp16 d and dmin, 12 bytes of 6-bit scales and mins, 128
    bytes of 4-bit codes) with random codes and scales: every byte pattern is a valid block,
    and the values are whatever llama.cpp's dequantization says."""
    import gguf

    rows, cols = array.shape
    blocks = np.random.default_rng(rows * cols).integers(
        0, 256, size=(rows, cols // 256, 144), dtype=np.uint8)
    blocks[..., 0:2] = np.frombuffer(np.float16(0.002).tobytes(), np.uint8)  # d
    blocks[..., 2:4] = np.frombuffer(np.float16(0.004).tobytes(), np.uint8)  # dmin
    return blocks.reshape(rows, -1), gguf.GGMLQuantizationType.Q4_K


def gguf_quantizer(kind: str):
    import gguf

    if kind == "Q4_K":
        return random_q4_k
    qtype = gguf.GGMLQuantizationType[kind]
    return lambda array: (gguf.quants.quantize(array, qtype), qtype)


@pytest.mark.parametrize("kind", ["Q8_0", "Q5_0", "Q5_1", "Q4_K"])
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
    inverse = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
               "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
               "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
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
