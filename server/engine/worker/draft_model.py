"""The draft model of speculative decoding (``method: draft_model``): a smaller checkpoint
with the target's tokenizer, proposing ``k`` tokens per sequence autoregressively.

Its KV cache has the target's blocks (the same block ids, the same slot for every token)
in its own layers' tensors, so the target's block tables and slot mappings address it as
they are. Every target step is *mirrored*: the draft runs the same padded inputs (the same
bucket, on its own graphs), so whatever K/V the target holds (prompt chunks, prefix-cache
hits, accepted drafts, the corrected token) the draft holds too, with no catch-up step of
its own shape. Proposing is then up to ``k`` plain decode steps of the draft, each
taking its argmax: a point-mass draft, which the target's rejection rule (rejection.py)
verifies as it is, keeping the target's distribution exactly.

An EAGLE head (eagle.py) is a draft of this kind whose steps also read the target's hidden
states: :class:`HiddenInputs` adds them to each step's inputs.

Every shape the draft runs is a planned bucket (the target's prefill, decode and verify
buckets; draft steps are decode buckets of query 1), warmed on the draft's graphs before
the port opens, and counted like the target's.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any, Protocol

import torch

from server.config import EngineConfig, ExecutionMode
from server.engine.core.block_manager import blocks_for
from server.engine.core.sequence import Sequence
from server.engine.worker.input_builder import InputBuilder
from server.hpu.buckets.lookup import ShapePlanner, exact_bucket, padded_size
from server.hpu.graph_runner import ForwardInputs, ShapeRunner
from server.hpu.kv_cache import KVCache
from server.hpu.layer_ops import TorchLayerOps
from server.hpu.platform import Platform
from server.hpu.types import Bucket, Phase
from server.models.llama import LlamaForCausalLM
from server.models.loader import LoadedModel

logger = logging.getLogger(__name__)


def prepare_draft(draft: LoadedModel, target: LoadedModel, ops: TorchLayerOps,
                  platform: Platform, mode: ExecutionMode, config: EngineConfig,
                  int4_weights: Callable[[], Mapping[str, Any]] | None, cache_dir: Path,
                  max_model_len: int, kv_dtype: torch.dtype) -> None:
    """Readies the draft like the target (packed linears, its checkpoint's 4-bit codes)
    and has it run the target's layer ops: one input layout serves both models. A draft
    that cannot share them is a start-up error naming why."""
    cfg, tcfg = draft.config, target.config
    where = "--speculative-config draft_model"
    if cfg.vocab_size != tcfg.vocab_size:
        raise ValueError(f"{where}: the draft's vocabulary ({cfg.vocab_size}) is not the "
                         f"target's ({tcfg.vocab_size}): it needs the same tokenizer")
    if cfg.max_position_embeddings < max_model_len:
        raise ValueError(f"{where}: the draft serves {cfg.max_position_embeddings} "
                         f"positions, less than --max-model-len {max_model_len}")
    # it mirrors the target's verify steps (k + 1 tokens per sequence)
    spec = config.speculative.settings
    platform.prepare_model(draft.model, mode, config.device, int4_weights, cache_dir,
                           spec.query_len if spec is not None else 1)
    window = cfg.min_window if (cfg.min_window or 0) < max_model_len else None
    partial = cfg.rotary_dim is not None and cfg.rotary_dim < cfg.head_dim
    if not ops.can_serve(kv_dtype, cfg.attn_softcap, window, partial):
        raise ValueError(f"{where}: the target's layer ops ({ops.name}) cannot serve the "
                         "draft's attention (soft cap, sliding window or partial rotary)")
    draft.model.serve_context(max_model_len)
    draft.model.use_ops(ops)
    logger.info("Draft model: %.1fM params, %d layers, %.1f MiB of weights",
                draft.num_params / 1e6, cfg.num_layers, draft.num_bytes / 2**20)


def draft_kv_bytes_per_block(draft: LoadedModel, block_size: int,
                             dtype: torch.dtype) -> int:
    """What one KV block costs in the draft's cache (added to the target's when sizing)."""
    return draft.config.kv_layout.bytes_per_block(block_size, dtype)


def allocate_draft_cache(draft: LoadedModel, ops: TorchLayerOps, num_blocks: int,
                         block_size: int, dtype: torch.dtype,
                         device: torch.device) -> list[KVCache]:
    return ops.kv_cache_views(draft.config.kv_layout.allocate(num_blocks, block_size, dtype,
                                                              device))


class DraftForward:
    """The draft's graphs' function: padded inputs -> float32 logits of each row's last
    token (the target's inputs, without LoRA slots: the draft has no adapters)."""

    def __init__(self, model: LlamaForCausalLM, kv_caches: list[KVCache]) -> None:
        self.model = model
        self.kv_caches = kv_caches

    def __call__(self, inputs: ForwardInputs) -> torch.Tensor:
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta,
                            None)
        hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, inputs.logits_indices)
        return self.model.compute_logits(hidden)


class HiddenInputs(Protocol):
    """What a draft that reads the target's hidden states adds to its steps' inputs."""

    def mirrored(self, inputs: ForwardInputs, seqs: list[Sequence], starts: list[int]
                 ) -> ForwardInputs: ...

    def proposing(self, inputs: ForwardInputs, standins: list[Sequence]) -> ForwardInputs: ...

    def warming(self, inputs: ForwardInputs) -> ForwardInputs: ...


class DraftModel:
    """The draft's graphs on the target's inputs and buckets: mirrors every target step,
    proposes drafts with its own decode steps. ``argmax``: logits -> the target's token
    ids; ``hidden``: an EAGLE head's hidden-state inputs (None: a draft model)."""

    def __init__(self, graphs: ShapeRunner, inputs: InputBuilder, shapes: ShapePlanner | None,
                 argmax: Callable[[torch.Tensor], torch.Tensor],
                 hidden: HiddenInputs | None = None) -> None:
        self.graphs = graphs
        self.inputs = inputs
        self.shapes = shapes
        self.argmax = argmax
        self.hidden = hidden

    def mirror(self, phase: Phase, bucket: Bucket, inputs: ForwardInputs,
               seqs: list[Sequence], starts: list[int]) -> None:
        """Writes the draft's K/V of a target step's tokens (the same bucket); ``starts``:
        where each row's first token sits in the flattened inputs."""
        inputs = _without_lora(inputs)
        if self.hidden is not None:
            inputs = self.hidden.mirrored(inputs, seqs, starts)
        self.graphs.run(phase, bucket, inputs)

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        """Up to ``limits[i]`` draft tokens for each sequence (their slots allocated):
        decode steps of the draft, each row leaving the batch once it has its drafts."""
        drafts: list[list[int]] = [[] for _ in seqs]
        block = self.inputs.block_size
        with torch.inference_mode():
            while True:
                rows = [i for i, limit in enumerate(limits) if len(drafts[i]) < limit]
                if not rows:
                    return drafts
                # each row as if its drafts so far were generated, with the blocks up to
                # its query's (the flat layout reads a table's last block as the current)
                standins = []
                for i in rows:
                    seq = seqs[i]
                    num = seq.num_tokens + len(drafts[i])
                    standins.append(dataclasses.replace(
                        seq, output_token_ids=seq.output_token_ids + drafts[i],
                        block_table=seq.block_table[:blocks_for(num, block)]))
                bs = len(standins)
                size = sum(len(s.block_table) for s in standins)
                bucket = (self.shapes.pad(Phase.DECODE, bs, size) if self.shapes is not None
                          else exact_bucket(Phase.DECODE, bs, size))
                inputs = self.inputs.decode(standins, padded_size(Phase.DECODE, bucket))
                if self.hidden is not None:
                    inputs = self.hidden.proposing(inputs, standins)
                logits = self.graphs.run(Phase.DECODE, bucket, inputs)[:bs]
                for i, token in zip(rows, self.argmax(logits).tolist()):
                    drafts[i].append(token)

    def warm(self, buckets: Mapping[Phase, Seq[Bucket]],
             make_inputs: Callable[[Phase, Bucket], ForwardInputs]) -> None:
        """Compiles (and captures, where the runner does) every planned bucket on the
        draft's graphs: called inside warmup, so they count as warmup compilations."""
        if not self.graphs.needs_warmup:
            return
        total = sum(len(b) for b in buckets.values())
        logger.info("Warming up the draft model's %d buckets", total)
        for phase, planned in buckets.items():
            for bucket in planned:
                inputs = _without_lora(make_inputs(phase, bucket))
                if self.hidden is not None:
                    inputs = self.hidden.warming(inputs)
                self.graphs.warm(phase, bucket, inputs)
                if self.graphs.captures_graphs:
                    self.graphs.capture(phase, bucket, inputs)


def _without_lora(inputs: ForwardInputs) -> ForwardInputs:
    if inputs.lora_slots is None:
        return inputs
    return dataclasses.replace(inputs, lora_slots=None)
