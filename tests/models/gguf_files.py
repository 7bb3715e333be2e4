"""GGUF files written from transformers models the way llama.cpp's converter
(convert_hf_to_gguf.py) lays them out, for the GGUF tests: tensor names and layouts per
family, Q/K rows permuted for "llama" / "granite" (Mixtral, Mistral included), Gemma 2/3's
norms stored as 1 + w, Phi-3's LongRoPE factors as tensors and partial rotary size, experts
stacked per layer."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import numpy as np

from server.models.rotary import rope_inv_freq

Quantizer = Callable[[np.ndarray], tuple[np.ndarray, object]]

# Hugging Face module (under model.layers.N) -> llama.cpp's block tensor
_PARTS = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "mlp.gate_up_proj": "ffn_up",  # Phi-3: gate rows then up rows, in one tensor
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate": "ffn_gate_inp", "mlp.experts.down_proj": "ffn_down_exps",
}
_GEMMA_PARTS = {"post_attention_layernorm": "post_attention_norm",
                "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}
LINEAR_PARTS = ("attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output", "ffn_gate", "ffn_up",
                "ffn_down")


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's conversion of HF Q/K rows to its interleaved RoPE layout."""
    return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


GEMMA = ("gemma2", "gemma3")


def _global_rope(cfg) -> dict:
    """The (global layers') RoPE parameters: Gemma 3 keeps one dict per layer type."""
    return cfg.rope_parameters.get("full_attention", cfg.rope_parameters)


def _header(writer, cfg, arch: str, head_dim: int, llama_scaling: dict | None) -> None:
    rope = _global_rope(cfg)
    theta = float(rope["rope_theta"])
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(theta)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    if getattr(cfg, "pad_token_id", None) is not None:
        writer.add_pad_token_id(cfg.pad_token_id)
    if arch in ("llama", "granite"):
        writer.add_rope_dimension_count(head_dim)
    elif arch == "phi3":  # Phi-4-mini's partial share, sized as the converter does
        partial = rope.get("partial_rotary_factor") or getattr(cfg, "partial_rotary_factor",
                                                               None) or 1.0
        writer.add_rope_dimension_count(int(partial * cfg.hidden_size)
                                        // cfg.num_attention_heads)
    else:  # qwen2 / qwen3 / qwen3moe / gemma2 / gemma3
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "granite":
        writer.add_embedding_scale(cfg.embedding_multiplier)
        writer.add_residual_scale(cfg.residual_multiplier)
        writer.add_attention_scale(cfg.attention_multiplier)
        writer.add_logit_scale(cfg.logits_scaling)
    elif arch == "llama" and llama_scaling is not None:  # Llama 3.1: rope_freqs divisors
        base = rope_inv_freq(head_dim, theta, None)
        scaled = rope_inv_freq(head_dim, theta, llama_scaling)
        writer.add_tensor("rope_freqs.weight", (base / scaled).numpy().astype(np.float32))
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        if arch == "qwen3moe":
            writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
        writer.add_sliding_window(cfg.sliding_window)
    if arch == "gemma3":
        import gguf

        if cfg.final_logit_softcapping:
            writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
        if "sliding_attention" in cfg.layer_types:
            writer.add_sliding_window(cfg.sliding_window)
        if rope.get("rope_type") == "linear":  # the global layers' scaling
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(rope["factor"])
    if arch == "phi3":
        writer.add_sliding_window(cfg.sliding_window or 0)
        original = rope.get("original_max_position_embeddings") \
            or getattr(cfg, "original_max_position_embeddings", None) \
            or cfg.max_position_embeddings
        writer.add_rope_scaling_orig_ctx_len(original)
        if rope.get("long_factor"):
            scale = cfg.max_position_embeddings / original
            writer.add_rope_scaling_attn_factors(
                math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
            for kind in ("long", "short"):
                writer.add_tensor(f"rope_factors_{kind}.weight",
                                  np.asarray(rope[f"{kind}_factor"], dtype=np.float32))


def _tensors(hf_model, arch: str) -> list[tuple[str, np.ndarray]]:
    """(llama.cpp name, float32 array) in llama.cpp's layouts."""
    cfg = hf_model.config
    permuted = arch in ("llama", "granite")
    parts = {**_PARTS, **(_GEMMA_PARTS if arch in GEMMA else {})}
    out = []
    for name, tensor in hf_model.state_dict().items():
        array = tensor.float().numpy()
        if name == "lm_head.weight":
            if arch in GEMMA:
                continue  # llama.cpp's Gemma 2 / 3 always tie the head
            out.append(("output.weight", array))
            continue
        if not name.startswith("model.layers."):
            top = {"model.embed_tokens.weight": "token_embd.weight",
                   "model.norm.weight": "output_norm.weight"}[name]
            out.append((top, array + 1 if arch in GEMMA and "norm" in top else array))
            continue
        _, _, layer, rest = name.split(".", 3)
        if rest == "mlp.experts.gate_up_proj":  # [E, 2I, H]: gate rows, then up rows
            half = array.shape[1] // 2
            out.append((f"blk.{layer}.ffn_gate_exps.weight", array[:, :half]))
            out.append((f"blk.{layer}.ffn_up_exps.weight", array[:, half:]))
            continue
        part, kind = (rest, "weight") if rest.startswith("mlp.experts.") \
            else rest.rsplit(".", 1)
        if permuted and kind == "weight" and part == "self_attn.q_proj":
            array = permute(array, cfg.num_attention_heads)
        elif permuted and kind == "weight" and part == "self_attn.k_proj":
            array = permute(array, cfg.num_key_value_heads)
        if arch in GEMMA and part.endswith("norm"):
            # llama.cpp's converter adds Gemma's 1 to every norm weight (Gemma 3's q/k too)
            array = array + 1
        out.append((f"blk.{layer}.{parts[part]}.{kind}", array))
    return out


def _tokenizer(writer, tokenizer) -> None:
    """A byte-level BPE tokenizer as llama.cpp's "gpt2" vocabulary (tokens by id, merges,
    special tokens as control tokens): what transformers rebuilds a tokenizer from."""
    import json

    model = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    special = set(tokenizer.all_special_ids)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in model["merges"]])
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)


def write_gguf(path: Path, hf_model, arch: str = "llama", quantize: Quantizer | None = None,
               llama_scaling: dict | None = None, tokenizer=None) -> None:
    """``hf_model`` as llama.cpp's converter writes ``arch``; ``quantize`` (array ->
    (raw blocks, GGML type)) stores the layers' linear weights quantized; ``tokenizer``
    (a byte-level BPE) makes the file servable on its own."""
    import gguf

    cfg = hf_model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer = gguf.GGUFWriter(str(path), arch)
    _header(writer, cfg, arch, head_dim, llama_scaling)
    if tokenizer is not None:
        _tokenizer(writer, tokenizer)
    for name, array in _tensors(hf_model, arch):
        part = name.split(".")[2] if name.startswith("blk.") else ""
        if quantize is not None and part in LINEAR_PARTS and array.ndim == 2:
            raw, qtype = quantize(np.ascontiguousarray(array))
            writer.add_tensor(name, raw, raw_dtype=qtype)
        else:
            writer.add_tensor(name, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# Byte offsets of the fp16 fields in each K-quant's 256-value block (the rest is codes and
# packed small scales, where every byte pattern is valid), and the block size.
_K_QUANT_FP16 = {"Q2_K": ((80, 82), 84), "Q3_K": ((108,), 110), "Q4_K": ((0, 2), 144),
                 "Q5_K": ((0, 2), 176), "Q6_K": ((208,), 210)}


def random_k_quant(kind: str) -> Quantizer:
    """Blocks of ``kind`` with random codes and small scales and fixed small fp16 factors
    (gguf-py cannot quantize K-quants): valid blocks whose values are whatever llama.cpp's
    dequantization says."""
    import gguf

    offsets, size = _K_QUANT_FP16[kind]

    def quantize(array: np.ndarray) -> tuple[np.ndarray, object]:
        rows, cols = array.shape
        blocks = np.random.default_rng(rows * cols).integers(
            0, 256, size=(rows, cols // 256, size), dtype=np.uint8)
        for i, offset in enumerate(offsets):  # d (0.002), then dmin (0.004) if any
            blocks[..., offset:offset + 2] = np.frombuffer(
                np.float16(0.002 * (i + 1)).tobytes(), np.uint8)
        return blocks.reshape(rows, -1), gguf.GGMLQuantizationType[kind]

    return quantize


random_q4_k = random_k_quant("Q4_K")


def gguf_quantizer(kind: str) -> Quantizer:
    import gguf

    if kind in _K_QUANT_FP16:
        return random_k_quant(kind)
    qtype = gguf.GGMLQuantizationType[kind]
    return lambda array: (gguf.quants.quantize(array, qtype), qtype)


def quantize_q4_k(array: np.ndarray) -> tuple[np.ndarray, object]:
    """Q4_K blocks of real weights (gguf-py cannot quantize K-quants): per 32-value
    sub-block an offset ``dmin * m`` (the sub-block's minimum, when below 0) and a step
    ``d * sc`` spanning its range, the 6-bit ``sc`` / ``m`` relative to per-256 fp16
    ``d`` / ``dmin``; plain rounding (llama.cpp searches better scales, same format)."""
    import gguf

    rows, cols = array.shape
    x = array.astype(np.float32).reshape(rows, cols // 256, 8, 32)
    mins = np.maximum(-x.min(axis=-1), 0)  # [R, S, 8], subtracted: w = d sc q - dmin m
    steps = (x.max(axis=-1) + mins) / 15
    d = (steps.max(axis=-1) / 63).astype(np.float16)
    dmin = (mins.max(axis=-1) / 63).astype(np.float16)
    safe = lambda v: np.where(v == 0, 1, v.astype(np.float32))[..., None]  # noqa: E731
    sc = np.clip(np.rint(steps / safe(d)), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(mins / safe(dmin)), 0, 63).astype(np.uint8)
    step = d.astype(np.float32)[..., None] * sc
    offset = dmin.astype(np.float32)[..., None] * m
    q = np.clip(np.rint((x + offset[..., None]) / np.where(step == 0, 1, step)[..., None]),
                0, 15).astype(np.uint8)
    scales = np.empty((rows, cols // 256, 12), np.uint8)
    scales[..., 0:4] = (sc[..., :4] & 0x3F) | ((sc[..., 4:] >> 4) << 6)
    scales[..., 4:8] = (m[..., :4] & 0x3F) | ((m[..., 4:] >> 4) << 6)
    scales[..., 8:12] = (sc[..., 4:] & 0x0F) | ((m[..., 4:] & 0x0F) << 4)
    pairs = q.reshape(rows, cols // 256, 4, 2, 32)  # sub-blocks 2c (low nibble), 2c + 1
    qs = (pairs[..., 0, :] | (pairs[..., 1, :] << 4)).reshape(rows, cols // 256, 128)
    blocks = np.concatenate([d[..., None].view(np.uint8), dmin[..., None].view(np.uint8),
                             scales, qs], axis=-1)
    return blocks.reshape(rows, -1), gguf.GGMLQuantizationType.Q4_K


def header_only_gguf(path: Path, arch: str, **header: int) -> Path:
    """A GGUF file with a header (``add_<key>`` of gguf's writer for each keyword) and one
    dummy tensor: enough for the config reader."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in header.items():
        getattr(writer, f"add_{key}")(value)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# llama.cpp's per-layer tensor names -> Hugging Face's (dense Llama-family layers), written
# out here rather than taken from the loader, so tests check the loader's own map
HF_LAYER_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                  "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                  "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                  "ffn_down": "mlp.down_proj"}
