"""One way to build a rank's model runner, the same on rank 0 and on every worker rank.

Rank 0 (the engine) and the tensor-parallel workers (``serve_rank``) both build their runner
here, so they resolve the same limits (the step's token budget included), size the same KV
cache and plan the same buckets: their collectives must match shape for shape. What differs
is given, not patched in later: rank 0 samples (its end-of-sequence ids) and wraps its
graph runner (``wrap_graphs``: the executor's broadcasting runner, which has every rank run
what rank 0 runs) and its LoRA slots (``wrap_lora``: every rank copies the same adapter into
the same slot).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from server.cache_dir import writable_cache_dir
from server.config import EngineConfig, ExecutionMode, SchedulerLimits, SpecMethod
from server.engine.worker.eagle import DraftHead
from server.engine.worker.model_runner import ModelRunner
from server.hpu.distributed import SINGLE, ParallelContext
from server.hpu.graph_runner import ShapeRunner
from server.hpu.platform import Platform
from server.models.eagle import load_eagle_head
from server.models.loader import (
    LoadedModel,
    ModelSource,
    load_int4_weights,
    load_model,
    resolve_model_source,
)
from server.models.lora import LoRASlots, SlotWriter
from server.models.mtp import DeepSeekMTP, load_mtp_head

logger = logging.getLogger(__name__)

# Wraps the platform's graph runner (tensor parallelism's rank 0: broadcast, then run).
GraphRunnerWrapper = Callable[[ShapeRunner], ShapeRunner]
# Wraps rank 0's LoRA slots the same way (broadcast each copy, then make it).
SlotsWrapper = Callable[[LoRASlots], SlotWriter]


def resolve_limits(config: EngineConfig, platform: Platform,
                   model_max_len: int) -> SchedulerLimits:
    """The scheduler's limits, with the step's token budget (``max_num_batched_tokens``)
    resolved: the flag, else the platform's default with chunked prefill, else a whole
    prompt. With static shapes (graphs, compile) a prefill with context runs alone, in a
    prompt bucket with context blocks."""
    static = platform.resolve_mode(config.device) is not ExecutionMode.EAGER
    return SchedulerLimits.resolve(
        config.scheduler, model_max_len, context_prefill_alone=static,
        default_max_num_batched_tokens=platform.default_max_num_batched_tokens)


def build_model_runner(config: EngineConfig, platform: Platform, source: ModelSource,
                       loaded: LoadedModel, parallel: ParallelContext = SINGLE,
                       eos_token_ids: frozenset[int] = frozenset(),
                       wrap_graphs: GraphRunnerWrapper | None = None,
                       wrap_lora: SlotsWrapper | None = None) -> ModelRunner:
    """The model runner of this rank for ``loaded`` (this rank's slices under tensor
    parallelism). ``eos_token_ids``: what the sampler stops on (rank 0 only samples)."""
    # A GGUF's own 4-bit codes, read only if the platform serves from them (whole
    # matrices: not under tensor parallelism, whose ranks hold slices).
    int4_weights = (functools.partial(load_int4_weights, source, loaded.config)
                    if source.is_gguf and config.model.quantization != "none"
                    and parallel.world_size == 1 else None)
    draft, draft_int4 = load_draft(config, platform, loaded, parallel)
    limits = resolve_limits(config, platform, loaded.config.max_position_embeddings)
    return ModelRunner(
        config, platform, loaded, limits,
        eos_token_ids, config.model.served_model_name or source.name,
        writable_cache_dir(config.cache_dir), int4_weights, parallel, wrap_graphs, wrap_lora,
        draft, draft_int4, load_head(config, source, loaded, parallel, limits.max_model_len))


def load_head(config: EngineConfig, target: ModelSource, loaded: LoadedModel,
              parallel: ParallelContext, max_model_len: int) -> DraftHead | None:
    """``--speculative-config`` eagle / eagle3: the head's checkpoint, in the target's
    dtype, sharing the target's embeddings (and EAGLE-1's LM head); mtp: the target's
    own MTP layer, from the target's checkpoint."""
    spec = config.speculative.settings
    if spec is None or not spec.method.reads_hidden_states:
        return None
    if parallel.world_size > 1:
        raise ValueError(f"--speculative-config {spec.method}: not with "
                         "--tensor-parallel-size > 1 yet")
    if loaded.config.mrope_section is not None:  # the head's RoPE reads plain positions
        raise ValueError(f"--speculative-config {spec.method}: not with an M-RoPE model "
                         "(Qwen2.5-VL) yet")
    if spec.method is SpecMethod.MTP:
        return load_mtp(spec.model, target, loaded)
    assert spec.model is not None
    if spec.method is SpecMethod.EAGLE3 and not hasattr(loaded.model, "emit_aux_hidden"):
        raise ValueError(f"--speculative-config eagle3: the {type(loaded.model).__name__} "
                         "target cannot emit its intermediate hidden states yet")
    source = resolve_model_source(spec.model)
    head = load_eagle_head(source.folder, spec.method.value, loaded.model, loaded.dtype,
                           next(loaded.model.parameters()).device, max_model_len)
    logger.info("%s head %s: %.1fM params of its own, target layers %s", spec.method,
                source.name, sum(p.numel() for p in head.parameters()
                                 if not any(p is q for q in loaded.model.parameters())) / 1e6,
                head.aux_layers or "(last hidden state)")
    return head


def load_mtp(model: str | None, target: ModelSource, loaded: LoadedModel) -> DeepSeekMTP:
    """The target's MTP layer (``model``: left out, or the target itself)."""
    if model is not None and resolve_model_source(model).folder != target.folder:
        raise ValueError("--speculative-config mtp: drafts with the target's own MTP layer; "
                         f"\"model\" ({model}) must be the target or left out")
    head = load_mtp_head(target.folder, target.is_gguf, loaded.model, loaded.dtype,
                         next(loaded.model.parameters()).device)
    shared = {id(p) for p in loaded.model.parameters()}
    own = sum(p.numel() for p in head.parameters() if id(p) not in shared)
    logger.info("mtp head: the target's layer %d, %.1fM params of its own (%s)",
                loaded.config.num_layers, own / 1e6,
                "sparse MLP" if head.config.moe_layers else "dense MLP")
    return head


def load_draft(config: EngineConfig, platform: Platform, loaded: LoadedModel,
               parallel: ParallelContext) -> tuple[LoadedModel | None, Any]:
    """``--speculative-config`` draft_model: the draft checkpoint, in the target's dtype (the
    two share the input tensors), and its GGUF 4-bit codes where it has them (whatever the
    target's --quantization: a draft is read for speed, e.g. a Q4 GGUF drafting for its
    own dense copy)."""
    spec = config.speculative.settings
    if spec is None or spec.method is not SpecMethod.DRAFT_MODEL:
        return None, None
    assert spec.model is not None
    if parallel.world_size > 1:
        raise ValueError("--speculative-config draft_model: not with --tensor-parallel-size "
                         "> 1 yet")
    source = resolve_model_source(spec.model)
    dtype = str(loaded.dtype).replace("torch.", "")
    draft = load_model(source, dtype, platform.device)
    int4 = (functools.partial(load_int4_weights, source, draft.config)
            if source.is_gguf else None)
    return draft, int4
