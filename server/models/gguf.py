"""Everything read from a GGUF file: the architecture (header) here, the weights
dequantized in gguf_tensors.py, the Q4_0 / Q4_1 / Q4_K weights kept as 4-bit codes in
gguf_quants.py.

Families follow llama.cpp's converter (convert_hf_to_gguf.py): "llama" (Mistral too; with
expert tensors: Mixtral), "qwen2", "qwen3", "qwen3moe", "granite", "phi3" (Phi-4-mini's
partial rotary included), "gemma2", "gemma3" (text), "llama4" (text); "deepseek2",
"gpt-oss" and "qwen3next" in gguf_families.py.
"""

from __future__ import annotations

import math
import os
import struct
import weakref
from typing import Any

import numpy as np

from server.models.config import ModelConfig
from server.models.errors import model_file_error
from server.models.gguf_check import check_gguf
from server.models.gguf_families import deepseek2_fields, gpt_oss_fields, qwen3next_fields
from server.models.gguf_quants import (  # noqa: F401  (re-exported: the loader's one import)
    GROUP_SIZE,
    HEAD,
    INT4_TYPES,
    Int4Weight,
    Q8Weight,
    dequantized_only,
    read_int4_weights,
    read_q8_head,
    split_blocks,
    tensor_types,
)
from server.models.gguf_tensors import ROPE_FREQ_FACTORS, dequantized_tensors  # noqa: F401
from server.models.registry import Architecture, gguf_architecture

# Live parses by (path, size, mtime): a rewritten file is parsed again.
_parses: weakref.WeakValueDictionary[tuple[str, int, int], Any] = weakref.WeakValueDictionary()


def open_gguf(path: str) -> Any:
    """The file's ``gguf.GGUFReader``: the one parse someone still holds, or a new one.

    Parsing takes seconds (SmolLM2's 49k-entry vocabulary), and a load reads one file
    several times (config, sampling defaults, weights, 4-bit codes): the load holds the
    parse from its first read to its last (``loader.gguf_parse``). Nothing keeps it
    after: a parse is ~500,000 Python objects (a numpy view per vocabulary entry) and
    ~140 MB, which a serving process would carry to its exit and walk in every full
    garbage collection."""
    stat = os.stat(path)
    key = (os.path.realpath(path), stat.st_size, stat.st_mtime_ns)
    reader = _parses.get(key)
    if reader is None:
        reader = _parse(path)
        _parses[key] = reader
    return reader


def _parse(path: str) -> Any:
    """The layout is checked against the file's size first (gguf_check.py): the reader
    takes a cut file for a shorter one."""
    import gguf

    check_gguf(path)
    try:
        return gguf.GGUFReader(path)
    except (ValueError, IndexError, struct.error) as exc:  # what the check cannot see
        raise model_file_error(path, f"unreadable GGUF ({exc})") from exc


class _Header:
    """A reader's metadata: ``get`` by full key, calling it by a key under llama.cpp's
    ``{general.architecture}.`` prefix."""

    def __init__(self, reader: Any) -> None:
        self.fields = reader.fields
        # the reader maps its file: a numpy memmap, which knows the path
        self.path = getattr(getattr(reader, "data", None), "filename", None) or "GGUF file"
        self.arch = str(self.required("general.architecture", full=True))

    def required(self, key: str, full: bool = False) -> Any:
        """A key the model cannot be built without; a file lacking it is damaged."""
        name = key if full else f"{self.arch}.{key}"
        value = self.get(name)
        if value is None:
            raise model_file_error(self.path, f"the GGUF metadata lacks {name!r}")
        return value

    def get(self, key: str, default: Any = None) -> Any:
        if key not in self.fields:
            return default
        field = self.fields[key]
        value = field.parts[field.data[0]] if field.data else None
        if value is not None and value.dtype.kind == "u" and value.itemsize == 1:
            return bytes(value).decode("utf-8")
        return value.item() if value is not None and value.size == 1 else value

    def __call__(self, key: str, default: Any = None) -> Any:
        return self.get(f"{self.arch}.{key}", default)

    def values(self, key: str) -> list[Any] | None:
        """Every element of an array key under the architecture's prefix (``get`` and the
        call read the first only), None when absent."""
        field = self.fields.get(f"{self.arch}.{key}")
        if field is None:
            return None
        return [field.parts[i].item() for i in field.data]


def gguf_model_config(reader: Any) -> ModelConfig:
    """Reads the llama.cpp metadata keys (``{arch}.block_count``...) of a GGUF file.

    Parsing the header ourselves reuses the reader we need for the tensors anyway;
    going through transformers' GGUF config would parse the whole file a second time.
    """
    h = _Header(reader)
    names = {t.name for t in reader.tensors}
    family = gguf_architecture(h.arch, moe=int(h("expert_count", 0) or 0) > 0)
    num_heads = int(h.required("attention.head_count"))
    hidden = int(h.required("embedding_length"))
    # Qwen3 and Gemma 2/3 write their (non hidden/heads) head size as the key length; older
    # llama files only as the rotary size; Phi-3's rotary size may be a partial share
    rope_dims = h("rope.dimension_count")
    head_dim = int(h("attention.key_length") or (
        rope_dims if rope_dims and family.model_type != "phi3" else hidden // num_heads))
    rotary_dim = _rotary_dim(family, rope_dims, head_dim)
    vocab = h("vocab_size") or len(h.fields["tokenizer.ggml.tokens"].data)
    eos = h.get("tokenizer.ggml.eos_token_id")
    fields: dict[str, Any] = dict(
        model_type=family.model_type,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(h.required("feed_forward_length")),
        num_layers=int(h.required("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(h("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rms_norm_eps=float(h("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(h("rope.freq_base", 10000.0)),
        rope_scaling=_longrope(reader, h, names) or _linear_rope(h),
        rotary_dim=rotary_dim,
        max_position_embeddings=int(h("context_length", 4096)),
        tie_word_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names or "blk.0.attn_qkv.bias" in names,
        o_bias="blk.0.attn_output.bias" in names,
        mlp_bias="blk.0.ffn_up.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        embedding_multiplier=float(h("embedding_scale", 1.0)),
        residual_multiplier=float(h("residual_scale", 1.0)),
        attention_multiplier=(float(h("attention.scale")) if h("attention.scale") else None),
        logits_scaling=float(h("logit_scale", 1.0)),
        sliding_window=int(h("attention.sliding_window") or 0) or None,
        checkpoint_dtype=None,
        eos_token_ids=(int(eos),) if eos is not None else (),
    )
    if family.moe:
        fields.update(_moe_fields(h, names, family, fields["num_layers"]))
    if family.gemma:
        fields.update(_gemma_fields(h, fields))
    if family.llama4:
        fields.update(_llama4_fields(h, fields["num_layers"]))
    if family.mla:
        fields.update(deepseek2_fields(h, fields))
    if family.gpt_oss:
        fields.update(gpt_oss_fields(h, fields))
    if family.hybrid:
        fields.update(qwen3next_fields(h, fields, names))
    return ModelConfig(**fields)


def _moe_fields(h: _Header, names: set[str], family: Architecture, num_layers: int
                ) -> dict[str, Any]:
    """Experts as llama.cpp writes them: counts in the header, the sparse layers being
    those with a router (``ffn_gate_inp``). llama.cpp renormalises the top-k weights of
    both Mixtral and Qwen3-MoE (newer files say so in ``expert_weights_norm``)."""
    norm = h("expert_weights_norm")
    return dict(
        num_experts=int(h("expert_count")),
        num_experts_per_tok=int(h("expert_used_count")),
        # Mixtral's experts are feed_forward_length wide; Qwen3-MoE has a size of its own
        moe_intermediate_size=int(h("expert_feed_forward_length")
                                  or h("feed_forward_length")),
        norm_topk_prob=family.moe_renormalize or (True if norm is None else bool(norm)),
        moe_layers=tuple(i for i in range(num_layers)
                         if f"blk.{i}.ffn_gate_inp.weight" in names),
    )


# What llama.cpp fixes for every Llama 4 file rather than reading it from the header (the
# released models' values): 8192-token chunks in three layers of four, the fourth without
# RoPE, its query temperature over floor 8192 with scale 0.1; the 128-expert model
# (Maverick) has no q/k norms
_LLAMA4_CHUNK = 8192
_LLAMA4_PATTERN = 4
_LLAMA4_TEMPERATURE = (8192.0, 0.1)
_LLAMA4_NO_QK_NORM_EXPERTS = 128


def _llama4_fields(h: _Header, num_layers: int) -> dict[str, Any]:
    """Llama 4 as llama.cpp runs it: feed_forward_length is the dense layers' MLP width,
    expert_feed_forward_length each expert's (and the shared one's); sigmoid routing, not
    renormalised. A ``sliding_window`` of 0 in the header (small all-global models) turns
    the chunks and NoPE layers off."""
    fields: dict[str, Any] = dict(
        norm_topk_prob=False, interleaved_rope=True,
        qk_l2_norm=int(h("expert_count")) != _LLAMA4_NO_QK_NORM_EXPERTS)
    if h("attention.sliding_window") == 0:
        return dict(fields, sliding_window=None)
    layers = range(num_layers)
    return dict(
        fields,
        sliding_window=None,
        attention_chunk_size=_LLAMA4_CHUNK,
        chunked_layers=tuple(i for i in layers if i % _LLAMA4_PATTERN < _LLAMA4_PATTERN - 1),
        nope_layers=tuple(i for i in layers if (i + 1) % _LLAMA4_PATTERN == 0),
        attn_temperature=_LLAMA4_TEMPERATURE,
    )


def _rotary_dim(family: Architecture, rope_dims: Any, head_dim: int) -> int | None:
    """RoPE over the first ``rope.dimension_count`` dims of each head (Phi-4-mini: 96 of
    128), None for the whole head. Only where Q/K rows keep the Hugging Face layout: llama.cpp
    rotates those NeoX-style (pairs i, i + n/2 of the first n dims), as transformers does;
    a permuted family's partial rotary would pair adjacent dims, which nothing exports."""
    if not rope_dims or int(rope_dims) == head_dim:
        return None
    if int(rope_dims) > head_dim or family.gguf_permuted_qk:
        raise ValueError(f"GGUF {family.model_type} with RoPE over {rope_dims} of {head_dim} "
                         "head dimensions is not supported")
    return int(rope_dims)


def _linear_rope(h: _Header) -> dict[str, Any] | None:
    """Linear RoPE scaling as the converter writes it (``rope.scaling.type`` / ``.factor``):
    Gemma 3's global layers (4B and up), linearly scaled Llama fine-tunes. Other types are
    read elsewhere (LongRoPE, Llama 3.1's rope_freqs) or not at all."""
    factor = h("rope.scaling.factor")
    if h("rope.scaling.type") != "linear" or not factor or float(factor) == 1.0:
        return None
    return dict(rope_type="linear", factor=float(factor))


# llama.cpp's layer count of the 27B models (Gemma 2, Gemma 3), whose score scale is
# hidden / heads rather than the head size
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# Gemma 3: llama.cpp windows five layers in six (every 6th global, as transformers'
# sliding_window_pattern 6) and rotates the windowed ones with an unscaled base of 10000
_GEMMA3_PATTERN = 6
_GEMMA3_LOCAL_BASE = 10000.0


def _gemma_fields(h: _Header, fields: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2 / 3 as llama.cpp runs them. Its converter stores every norm weight as
    ``1 + w`` (Gemma 3's q/k norms too: no offset to add at load) and drops
    ``query_pre_attn_scalar``: llama.cpp scales scores by ``1/sqrt(head_dim)``, except for
    the 27B models whose scalar is hidden / heads (which is what their configs say), unless
    the file has a scale."""
    big = fields["num_layers"] == _GEMMA_27B_LAYERS.get(h.arch)
    scalar = fields["hidden_size"] // fields["num_heads"] if big else fields["head_dim"]
    gemma3 = h.arch == "gemma3"
    return dict(
        mlp_act="gelu_tanh",
        embedding_multiplier=math.sqrt(fields["hidden_size"]),
        attention_multiplier=fields["attention_multiplier"] or scalar ** -0.5,
        attn_softcap=float(h("attn_logit_softcapping") or 0) or None,
        final_softcap=float(h("final_logit_softcapping") or 0) or None,
        sandwich_norms=True,
        norm_offset=0.0,
        sliding_layers=(_gemma_sliding_layers(h, fields["num_layers"])
                        if fields["sliding_window"] else None),
        # Gemma 3's windowed layers keep their own RoPE (the header's base and linear
        # scaling are the global layers'); newer files may name the local base
        local_rope_theta=(float(h("rope.freq_base_swa") or _GEMMA3_LOCAL_BASE)
                          if gemma3 else None),
    )


def _gemma_sliding_layers(h: _Header, num_layers: int) -> tuple[int, ...]:
    """The windowed layers: an explicit ``attention.sliding_window_pattern`` (per-layer
    flags) where the file has one, else llama.cpp's fixed pattern per family: Gemma 2
    alternates, the first windowed (pattern 2); Gemma 3 windows five in six."""
    flags = h.values("attention.sliding_window_pattern")
    if flags is not None and len(flags) == num_layers:
        return tuple(i for i, windowed in enumerate(flags) if windowed)
    pattern = int(flags[0]) if flags else _GEMMA3_PATTERN if h.arch == "gemma3" else 2
    return tuple(i for i in range(num_layers) if i % pattern < pattern - 1)


def _longrope(reader: Any, h: _Header, names: set[str]) -> dict[str, Any] | None:
    """Phi-3's LongRoPE: llama.cpp stores the short and long per-frequency divisors as
    tensors (``rope_factors_short`` / ``_long``), the original context and the attention
    factor in the header; rebuilt as the Hugging Face ``rope_scaling`` dict."""
    if "rope_factors_long.weight" not in names:
        return None
    tensors = {t.name: t for t in reader.tensors}
    factors = {kind: np.asarray(tensors[f"rope_factors_{kind}.weight"].data,
                                dtype=np.float32).ravel().tolist()
               for kind in ("short", "long")}
    scaling: dict[str, Any] = dict(
        rope_type="longrope", short_factor=factors["short"], long_factor=factors["long"],
        original_max_position_embeddings=int(h("rope.scaling.original_context_length")
                                             or h("context_length")))
    if h("rope.scaling.attn_factor") is not None:
        scaling["attention_factor"] = float(h("rope.scaling.attn_factor"))
    return scaling
