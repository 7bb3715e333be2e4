"""Everything read from a GGUF file: the architecture (header), the weights dequantized,
and the Q4_0 / Q4_1 weights kept as 4-bit codes.

One map from llama.cpp's tensor names to ours and one undoing of llama.cpp's Q/K row
permutation serve both the dequantized weights and the 4-bit codes, so a module's codes line
up with its dense weight row for row.

4-bit codes: ``w = (q - 8) * scale + zero`` with ``q`` in 0..15 represents both formats
exactly (Q4_0: ``d * (q - 8)``; Q4_1: ``d * q + m``), and is the convention of torch's int4
weight-only matmul kernels.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

from server.models.config import ModelConfig
from server.models.registry import ARCHITECTURES, gguf_architecture

GROUP_SIZE = 32  # GGUF's block length along the input dimension

# Pseudo-name under which the rope_freqs tensor (Llama 3.1's RoPE scaling) is yielded.
ROPE_FREQ_FACTORS = "rotary.freq_factors"

_TOP_LEVEL_NAMES = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": ROPE_FREQ_FACTORS,
}
# llama.cpp's per-block tensor -> (Hugging Face module, our fused module, shard in it)
_BLOCK_NAMES = {
    "attn_norm": ("input_layernorm", "input_layernorm", 0),
    "ffn_norm": ("post_attention_layernorm", "post_attention_layernorm", 0),
    "attn_q": ("self_attn.q_proj", "self_attn.qkv_proj", 0),
    "attn_k": ("self_attn.k_proj", "self_attn.qkv_proj", 1),
    "attn_v": ("self_attn.v_proj", "self_attn.qkv_proj", 2),
    "attn_output": ("self_attn.o_proj", "self_attn.o_proj", 0),
    "ffn_gate": ("mlp.gate_proj", "mlp.gate_up_proj", 0),
    "ffn_up": ("mlp.up_proj", "mlp.gate_up_proj", 1),
    "ffn_down": ("mlp.down_proj", "mlp.down_proj", 0),
    "attn_q_norm": ("self_attn.q_norm", "self_attn.q_norm", 0),
    "attn_k_norm": ("self_attn.k_norm", "self_attn.k_norm", 0),
}
_SHARDS = {"self_attn.qkv_proj": 3, "mlp.gate_up_proj": 2, "self_attn.o_proj": 1,
           "mlp.down_proj": 1}
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def open_gguf(path: str) -> object:
    """The file's ``gguf.GGUFReader``, parsed once per process (see ``_open``)."""
    stat = os.stat(path)
    return _open(path, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _open(path: str, size: int, mtime_ns: int) -> object:
    """Reading the metadata (a 49k-entry vocabulary for SmolLM2) takes seconds, and the
    config, the weights and the 4-bit codes all read the same file (size and mtime in the
    key: a rewritten file is parsed again)."""
    del size, mtime_ns
    import gguf

    return gguf.GGUFReader(path)


def gguf_model_config(reader: object) -> ModelConfig:
    """Reads the llama.cpp metadata keys (``{arch}.block_count``...) of a GGUF file.

    Parsing the header ourselves reuses the reader we need for the tensors anyway;
    going through transformers' GGUF config would parse the whole file a second time.
    """
    fields = reader.fields  # type: ignore[attr-defined]

    def get(key: str, default: object = None) -> object:
        if key not in fields:
            return default
        field = fields[key]
        value = field.parts[field.data[0]] if field.data else None
        if value is not None and value.dtype.kind == "u" and value.itemsize == 1:
            return bytes(value).decode("utf-8")
        return value.item() if value is not None and value.size == 1 else value

    arch = str(get("general.architecture"))
    family = gguf_architecture(arch)
    if int(get(f"{arch}.expert_count", 0) or 0) > 0:  # llama.cpp's Mixtral is "llama" too
        raise ValueError(f"GGUF {arch!r} file with {get(f'{arch}.expert_count')} experts: "
                         "mixture-of-experts models load from Hugging Face folders only")
    names = {t.name for t in reader.tensors}  # type: ignore[attr-defined]
    num_heads = int(get(f"{arch}.attention.head_count"))
    hidden = int(get(f"{arch}.embedding_length"))
    vocab = get(f"{arch}.vocab_size") or len(fields["tokenizer.ggml.tokens"].data)
    eos = get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        model_type=family.model_type,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get(f"{arch}.feed_forward_length")),
        num_layers=int(get(f"{arch}.block_count")),
        num_heads=num_heads,
        num_kv_heads=int(get(f"{arch}.attention.head_count_kv", num_heads)),
        # Qwen3 writes its (non hidden/heads) head size as the key length
        head_dim=int(get(f"{arch}.attention.key_length")
                     or get(f"{arch}.rope.dimension_count", hidden // num_heads)),
        rms_norm_eps=float(get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(get(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=None,
        max_position_embeddings=int(get(f"{arch}.context_length", 4096)),
        tie_word_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        o_bias="blk.0.attn_output.bias" in names,
        mlp_bias="blk.0.ffn_up.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        embedding_multiplier=float(get(f"{arch}.embedding_scale", 1.0)),
        residual_multiplier=float(get(f"{arch}.residual_scale", 1.0)),
        attention_multiplier=(float(get(f"{arch}.attention.scale"))
                              if get(f"{arch}.attention.scale") else None),
        logits_scaling=float(get(f"{arch}.logit_scale", 1.0)),
        sliding_window=int(get(f"{arch}.attention.sliding_window") or 0) or None,
        checkpoint_dtype=None,
        eos_token_ids=(int(eos),) if eos is not None else (),
    )


def _unpermutes(cfg: ModelConfig) -> bool:
    # llama.cpp's converter permutes Q/K rows for its interleaved RoPE on "llama" models
    # only; Qwen2/Qwen3 GGUFs keep the Hugging Face layout.
    return next(a.gguf_permuted_qk for a in ARCHITECTURES.values()
                if a.model_type == cfg.model_type)


def _unpermute(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (rows only; any trailing shape)."""
    rows = t.shape[0]
    return (t.reshape(num_heads, rows // num_heads // 2, 2, *t.shape[1:])
            .transpose(1, 2).reshape(t.shape))


def _q_or_k_heads(part: str, cfg: ModelConfig) -> int | None:
    if not _unpermutes(cfg):
        return None
    return {"attn_q": cfg.num_heads, "attn_k": cfg.num_kv_heads}.get(part)


def dequantized_tensors(reader: object, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, float32 tensor) for every tensor the model uses."""
    import gguf

    for t in tqdm(reader.tensors, desc="Dequantizing GGUF", unit="tensor", leave=False):  # type: ignore[attr-defined]
        match = _BLOCK_TENSOR.match(t.name)
        if match is not None and match.group(2) in _BLOCK_NAMES:
            layer, part, kind = match.groups()
            name = f"layers.{layer}.{_BLOCK_NAMES[part][0]}.{kind}"
        elif t.name in _TOP_LEVEL_NAMES:
            part, name = "", _TOP_LEVEL_NAMES[t.name]
        else:
            continue
        weights = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())
        heads = _q_or_k_heads(part, cfg)
        if heads is not None and kind == "weight":
            weights = _unpermute(weights, heads)
        yield name, weights


@dataclass(slots=True)
class Int4Weight:
    """One linear layer's weight as 4-bit codes: ``codes`` uint8 ``[N, K]`` (0..15),
    ``scale`` / ``zero`` float32 ``[N, K // GROUP_SIZE]``."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        scale = self.scale.repeat_interleave(GROUP_SIZE, dim=1)
        zero = self.zero.repeat_interleave(GROUP_SIZE, dim=1)
        return (self.codes.float() - 8) * scale + zero


def _split_blocks(data: np.ndarray, type_name: str) -> tuple[np.ndarray, ...]:
    """Raw rows ``[N, blocks * bytes]`` -> codes ``[N, K]``, scale and zero ``[N, blocks]``."""
    width = 18 if type_name == "Q4_0" else 20
    blocks = data.reshape(data.shape[0], -1, width)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if type_name == "Q4_0":
        zero = np.zeros_like(d)
        packed = blocks[..., 2:]
    else:
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        zero = m + 8 * d
        packed = blocks[..., 4:]
    # Within a block, byte j holds element j in its low nibble and element j + 16 high.
    codes = np.concatenate([packed & 0x0F, packed >> 4], axis=-1)
    return codes.reshape(data.shape[0], -1), d, zero


def read_int4_weights(reader: object, cfg: ModelConfig) -> dict[str, Int4Weight]:
    """Module name (``layers.3.mlp.down_proj``) -> its weight, for every linear layer whose
    shards are all Q4_0/Q4_1 in the file; layers with any other shard type are left out."""
    shards: dict[str, dict[int, tuple[torch.Tensor, ...]]] = {}
    rejected: set[str] = set()
    for t in reader.tensors:  # type: ignore[attr-defined]
        match = _BLOCK_TENSOR.match(t.name)
        if match is None or match.group(3) != "weight" or match.group(2) not in _BLOCK_NAMES:
            continue
        part = match.group(2)
        _, module, shard = _BLOCK_NAMES[part]
        if module not in _SHARDS:
            continue
        name = f"layers.{match.group(1)}.{module}"
        if t.tensor_type.name not in ("Q4_0", "Q4_1"):
            rejected.add(name)
            continue
        arrays = _split_blocks(t.data, t.tensor_type.name)
        codes, scale, zero = (torch.from_numpy(a) for a in arrays)
        heads = _q_or_k_heads(part, cfg)
        if heads is not None:
            codes, scale, zero = (_unpermute(a, heads) for a in (codes, scale, zero))
        shards.setdefault(name, {})[shard] = (codes, scale, zero)
    weights = {}
    for name, parts in shards.items():
        if name in rejected or len(parts) != _SHARDS[name.split(".", 2)[2]]:
            continue
        ordered = [parts[i] for i in range(len(parts))]
        weights[name] = Int4Weight(*(torch.cat(col).contiguous() for col in zip(*ordered)))
    return weights
