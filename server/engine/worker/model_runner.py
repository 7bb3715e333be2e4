"""The model's device resources, and one step on them: batch -> padded tensors -> model
-> sampler.

:class:`ModelRunner` is built once from the config: it prepares the loaded weights for the
platform (layer ops, packed or quantized linears), sizes and allocates the KV cache, picks
the graph runner of the execution mode and the bucket shapes, and warms them up. Build it
with :func:`server.engine.worker.builder.build_model_runner`, as every rank does.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from server.config import EngineConfig, SchedulerLimits
from server.engine.core.block_manager import blocks_for
from server.engine.core.sequence import ScheduledBatch, Sequence
from server.engine.lora.manager import LoRAManager, lora_dtype
from server.engine.multimodal.encoder import VisionEncoder
from server.engine.multimodal.plan import encoder_plan
from server.engine.outputs import ModelRunnerOutput, TokenLogprob
from server.engine.sampling_params import SamplingParams
from server.engine.sleep import SleepLevel, WakeTag
from server.engine.worker.draft_model import (
    DraftForward,
    DraftModel,
    allocate_draft_cache,
    draft_kv_bytes_per_block,
    prepare_draft,
)
from server.engine.worker.eagle import (
    DraftHead,
    EagleForward,
    FeatureStore,
    FeatureTap,
    HeadInputs,
    head_kv_bytes_per_block,
    prepare_head,
)
from server.engine.worker.input_builder import InputBuilder, dummy_seq
from server.engine.worker.prompt_logprobs import all_rows, flat_starts, score, scored_chunks
from server.engine.worker.rejection import verify, verify_rows
from server.engine.worker.sampler import Sampler, SamplingTensors, to_token_logprobs
from server.engine.worker.sleep import DeviceMemory, WeightLoader
from server.engine.worker.state_plan import plan_state_cache
from server.hpu.buckets.adaptive import AdaptiveBuckets
from server.hpu.buckets.lookup import ShapePlanner, exact_bucket, padded_size
from server.hpu.buckets.plan import (
    decode_buckets,
    format_plan,
    prefill_buckets,
    resolve_ranges,
    verify_buckets,
)
from server.hpu.counters import DeviceCounters
from server.hpu.distributed import SINGLE, ParallelContext
from server.hpu.graph_runner import ForwardInputs, ShapeRunner
from server.hpu.kv_cache import KVCache, cache_bytes, num_kv_blocks
from server.hpu.layer_ops import TorchLayerOps
from server.hpu.platform import Platform
from server.hpu.state_cache import LayerState
from server.hpu.types import Bucket, BucketLimits, DecodeLayout, Phase, SyncPoint
from server.hpu.warmup import WarmupHooks, run_warmup
from server.models.llama import LlamaForCausalLM
from server.models.loader import LoadedModel
from server.models.lora import LoRASlots, SlotWriter
from server.models.vision import with_processor_kwargs

logger = logging.getLogger(__name__)


class ModelForward:
    """What graphs are made of: padded inputs -> float32 logits ``[bs, vocab]`` of each
    row's last token, padding rows included. A pure function of tensors (the KV cache is
    updated in place), so it can be compiled or captured per bucket."""

    def __init__(self, model: LlamaForCausalLM, kv_caches: list[KVCache],
                 state_caches: list[LayerState] | None = None,
                 tap: FeatureTap | None = None) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.state_caches = state_caches  # hybrid models: their linear layers' states
        self.tap = tap  # an EAGLE head's: each token's feature stored at its slot

    def __call__(self, inputs: ForwardInputs) -> torch.Tensor:
        if self.state_caches is None:
            images = ({} if inputs.mm_embeds is None
                      else {"mm_embeds": inputs.mm_embeds, "mm_mask": inputs.mm_mask})
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches,
                                inputs.meta, inputs.lora_slots, **images)
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches,
                                inputs.meta, None, self.state_caches, inputs.state)
        if self.tap is not None:
            hidden = self.tap(hidden, inputs.meta.slot_mapping)
        hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, inputs.logits_indices)
        return self.model.compute_logits(hidden)


class ModelRunner:
    """Owns the model, its KV cache, its graphs and the sampler, for one platform."""

    def __init__(self, config: EngineConfig, platform: Platform, loaded: LoadedModel,
                 limits: SchedulerLimits, eos_token_ids: frozenset[int], model_name: str,
                 cache_dir: Path,
                 int4_weights: Callable[[], Mapping[str, Any]] | None = None,
                 parallel: ParallelContext = SINGLE,
                 wrap_graphs: Callable[[ShapeRunner], ShapeRunner] | None = None,
                 wrap_lora: Callable[[LoRASlots], SlotWriter] | None = None,
                 draft: LoadedModel | None = None,
                 draft_int4_weights: Callable[[], Mapping[str, Any]] | None = None,
                 head: DraftHead | None = None) -> None:
        self.platform = platform
        self.limits = limits
        self.model = loaded.model
        self.dtype = loaded.dtype
        self.eos_token_ids = eos_token_ids
        self.vocab_size = loaded.config.vocab_size
        self.block_size = config.cache.block_size
        self.counters = DeviceCounters(model_name)
        mode = platform.resolve_mode(config.device)
        spec = config.speculative.settings
        ops = platform.prepare_model(loaded.model, mode, config.device, int4_weights, cache_dir,
                                     spec.query_len if spec is not None else 1)
        self.kv_dtype = kv_cache_dtype(config.cache.kv_cache_dtype, loaded.dtype)
        cfg = loaded.config
        # a window as long as the served context masks nothing: full attention serves it
        window = cfg.min_window if (cfg.min_window or 0) < limits.max_model_len else None
        partial_rotary = cfg.rotary_dim is not None and cfg.rotary_dim < cfg.head_dim
        latent = cfg.mla is not None  # no fused kernel reads a latent cache
        if latent or not ops.can_serve(self.kv_dtype, cfg.attn_softcap, window, partial_rotary):
            needs = [f"a {str(self.kv_dtype).replace('torch.', '')} KV cache"]
            needs += ["multi-head latent attention"] if latent else []
            needs += ["soft-capped attention"] if cfg.attn_softcap else []
            needs += [f"a {window}-token sliding window"] if window else []
            needs += ["partial rotary embeddings"] if partial_rotary else []
            logger.info("Layer ops: PyTorch (%s cannot serve all of: %s)", ops.name,
                        ", ".join(needs))
            ops = TorchLayerOps()
        loaded.model.serve_context(limits.max_model_len)
        loaded.model.use_ops(ops)
        if latent:
            logger.info("Attention: multi-head latent (MLA) on %s ops: fresh prompts expand "
                        "the latents to per-head keys and values, decode and prompts after "
                        "a cached context attend in the latent space (W_UK absorbed into "
                        "the queries, W_UV applied after)", ops.name)
        # --enable-lora: fixed adapter slots in every layer, before any graph is built
        self.lora: LoRAManager | None = None
        if config.lora.enable_lora:
            plan = loaded.plan  # tensor parallelism: each rank holds its part of a slot
            slots = LoRASlots(cfg, config.lora.max_loras, config.lora.max_lora_rank,
                              lora_dtype(config.lora.lora_dtype, loaded.dtype), platform.device,
                              plan.shard_lora if plan is not None else None, ops.lora_kernel)
            loaded.model.enable_lora(slots)
            self.lora = LoRAManager(config.lora, plan.config if plan is not None else cfg,
                                    slots if wrap_lora is None else wrap_lora(slots))
            logger.info("LoRA: %d slots of rank %d, %.1f MiB", slots.num_slots,
                        slots.max_rank, slots.nbytes / 2**20)
        # hybrid models (Qwen3-Next): a state slot per running sequence beside the KV
        # cache, from the same memory budget; prefix caching does not apply to them
        self.state = plan_state_cache(config, loaded, limits)
        self.prefix_caching = config.cache.enable_prefix_caching and self.state is None
        # a vision-language model: the encoder phase of prefills, its buckets and cache
        self.vision: VisionEncoder | None = None
        if loaded.vision is not None:
            mm = config.multimodal
            plan = encoder_plan(with_processor_kwargs(loaded.vision.config, mm.processor_kwargs),
                                mm.image_limit, limits.max_num_seqs,
                                limits.max_num_batched_tokens)
            self.vision = VisionEncoder(loaded.vision, plan, mode, self.counters,
                                        platform.device, loaded.dtype,
                                        cache_images=mm.mm_encoder_cache_images)
            logger.info("%s", self.vision.describe())
        # --speculative-config draft_model: the draft runs the target's layer ops (one
        # input layout for both) and holds the target's blocks in its own cache
        draft_block_bytes = 0
        if draft is not None:
            if cfg.mrope_section is not None:  # the draft's RoPE reads plain positions
                raise ValueError("--speculative-config draft_model: not with an M-RoPE "
                                 "model (Qwen2.5-VL) yet")
            if config.device.enable_sleep_mode:
                raise ValueError("--speculative-config draft_model: not with "
                                 "--enable-sleep-mode yet")
            prepare_draft(draft, loaded, ops, platform, mode, config, draft_int4_weights,
                          cache_dir, limits.max_model_len, self.kv_dtype)
            draft_block_bytes = draft_kv_bytes_per_block(draft, self.block_size,
                                                         self.kv_dtype)
        # --speculative-config eagle / eagle3: the head's layer beside the target's, and
        # the target's features per KV slot (eagle.py)
        if head is not None:
            if config.device.enable_sleep_mode:
                raise ValueError(f"--speculative-config {spec.method if spec else 'eagle'}: "
                                 "not with --enable-sleep-mode yet")
            prepare_head(head, loaded.model, ops)
            draft_block_bytes = head_kv_bytes_per_block(head, self.block_size, self.kv_dtype,
                                                        loaded.dtype)
        # every rank must hold the same blocks (rank 0's block tables address them all)
        self.kv_layout = cfg.kv_layout
        logger.info("KV cache layout: %s", self.kv_layout.describe(self.kv_dtype))
        self.num_blocks = parallel.min_int(self._num_blocks(config, loaded, limits,
                                                            draft_block_bytes))
        self.kv_caches = ops.kv_cache_views(self.kv_layout.allocate(
            self.num_blocks, self.block_size, self.kv_dtype, platform.device))
        draft_caches = (allocate_draft_cache(draft, ops, self.num_blocks, self.block_size,
                                             self.kv_dtype, platform.device)
                        if draft is not None else [])
        store: FeatureStore | None = None
        if head is not None:
            draft_caches = ops.kv_cache_views(head.config.kv_layout.allocate(
                self.num_blocks, self.block_size, self.kv_dtype, platform.device))
            store = FeatureStore(self.num_blocks, self.block_size, head.hidden_size,
                                 loaded.dtype, platform.device)
        self.kv_cache_bytes = cache_bytes(self.kv_caches + draft_caches) + (
            store.nbytes if store is not None else 0)
        self.state_caches = (self.state.allocate(platform.device) if self.state is not None
                             else None)
        self.counters.cache_config(self.block_size, self.kv_dtype, self.num_blocks,
                                   self.kv_cache_bytes)
        self.inputs = InputBuilder(self.block_size, self.num_blocks, platform.device,
                                   loaded.dtype, limits.max_model_len, ops.decode_layout,
                                   self.state.pad_slot if self.state is not None else None,
                                   mrope=cfg.mrope_section is not None)
        graphs: ShapeRunner = platform.graph_runner(
            mode, ModelForward(loaded.model, self.kv_caches, self.state_caches,
                               FeatureTap(head, store) if head is not None and store else None),
            self.counters, loaded.model, config.device)
        self.graphs = graphs if wrap_graphs is None else wrap_graphs(graphs)
        self.sampler = Sampler(ops.argmax)
        draft_graphs = (platform.graph_runner(mode, DraftForward(draft.model, draft_caches),
                                              self.counters, draft.model, config.device)
                        if draft is not None else None)
        if head is not None and store is not None:
            draft_graphs = platform.graph_runner(mode, EagleForward(head, draft_caches, store),
                                                 self.counters, head, config.device)
        # Eager with per-row block tables: a prefill's tokens are packed back to back with
        # no padding, and decodes can ride in the same forward as prompt chunks (one
        # forward per step, the decode rows inside the chunk's large matmuls). Graphs and
        # the reference ops keep the padded [bs, q] grid of the buckets.
        # (not hybrid models: their linear layers read each row's tokens as one sequence)
        self.packs_tokens = (not self.graphs.needs_warmup and self.state is None
                             and ops.decode_layout is DecodeLayout.BLOCK_TABLES)
        self.warmup_config = config.warmup
        ranges = resolve_ranges(
            config.bucketing, block_size=self.block_size, max_model_len=limits.max_model_len,
            max_num_seqs=limits.max_num_seqs,
            max_num_batched_tokens=limits.max_num_batched_tokens,
            num_blocks=self.num_blocks,
            with_context=limits.chunked_prefill or self.prefix_caching)
        # Padding only pays where shapes are compiled or captured; plain eager PyTorch
        # would just compute the padding.
        self.shapes: ShapePlanner | None = None
        # --speculative-config: verify steps run decode buckets of this query length
        self.spec_query = spec.query_len if spec is not None else None
        if ranges.enabled and self.graphs.needs_warmup:
            verify = (verify_buckets(ranges, spec.query_len, spec.disable_by_batch_size)
                      if spec is not None else [])
            self.shapes = ShapePlanner(prefill_buckets(ranges), decode_buckets(ranges) + verify,
                                       self.counters)
            for line in format_plan(ranges, verify).splitlines():
                logger.info("%s", line)
        bucket_limits = BucketLimits(limits.max_model_len, limits.max_num_seqs,
                                     limits.max_num_batched_tokens, self.num_blocks)
        argmax = self.sampler.argmax
        if head is not None:  # EAGLE-3 drafts over its own vocabulary
            def argmax(logits: torch.Tensor) -> torch.Tensor:
                return head.to_target_ids(self.sampler.argmax(logits))
        self.draft = (DraftModel(draft_graphs, self.inputs, self.shapes, argmax,
                                 HeadInputs(store) if store is not None else None)
                      if draft_graphs is not None else None)
        self.adaptive: AdaptiveBuckets | None = None
        if self.shapes is not None and config.bucketing.adaptive:
            b = config.bucketing
            self.adaptive = AdaptiveBuckets(
                self.shapes, self.counters, self.block_size, bucket_limits,
                interval=b.adaptive_interval, min_saving=b.adaptive_min_saving,
                max_added=b.adaptive_max_added)
        self._free_after_warmup = 0
        # --enable-sleep-mode: what sleep frees and wake restores, and where weights come from
        self.memory: DeviceMemory | None = None
        self.weight_loader: WeightLoader | None = None
        if config.device.enable_sleep_mode:
            self.memory = DeviceMemory(loaded.model, self.kv_caches,
                                       platform.device.type != "cpu", platform.device)
            self.weight_loader = WeightLoader(config, platform, mode, cfg, loaded.dtype,
                                              limits.max_model_len, cache_dir)
        # captured graphs hold addresses that a storage resized to 0 and back changes
        self._graphs_stale = False
        self.counters.observed.describe(
            block_size=self.block_size, limits=bucket_limits,
            plan=self.shapes.buckets if self.shapes is not None else None,
            static_shapes=self.graphs.needs_warmup)

    @property
    def pad_block_id(self) -> int:
        return self.inputs.pad_block_id

    def prefill_fits(self, num_seqs: int, max_tokens: int) -> bool:
        """Whether a prefill of this many sequences, the longest ``max_tokens`` long, still
        has a bucket within the step's token budget once padded."""
        return self.shapes is None or self.shapes.prefill_fits(
            num_seqs, max_tokens, self.limits.max_num_batched_tokens)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch,
                token_bitmask: torch.Tensor | None = None) -> ModelRunnerOutput:
        """One step: ``token_bitmask`` (structured outputs, ``[rows, words]``) restricts
        the tokens each row may sample."""
        seqs = batch.seqs
        phase = batch.phase
        new_tokens = [batch.new_tokens(row) for row in range(len(seqs))]
        if batch.spec_token_ids is not None:
            return self._verify(batch, new_tokens, token_bitmask)
        bucket = self._bucket(phase, seqs, new_tokens)
        pad_to = padded_size(phase, bucket)
        packed = (phase is Phase.PREFILL and self.packs_tokens
                  and not self._bidirectional_step(seqs, new_tokens))
        if packed:
            inputs = self.inputs.packed(seqs, new_tokens)
        elif phase is Phase.PREFILL:
            # with graphs the bucket fixes the context width (and whether there is one);
            # eager execution follows the data
            inputs = self.inputs.prefill(seqs, pad_to, new_tokens,
                                         bucket.blocks if self.graphs.needs_warmup else None)
        else:
            inputs = self.inputs.decode(seqs, pad_to)
        if self.lora is not None:
            inputs = self._with_lora(inputs, seqs, new_tokens, packed)
        if self.vision is not None and phase is Phase.PREFILL:
            inputs = self._with_images(inputs, seqs, new_tokens, packed)
        self.counters.tokens(phase, sum(new_tokens), inputs.input_ids.numel())
        scored = scored_chunks(seqs, new_tokens) if phase is Phase.PREFILL else []
        prompt_logprobs: dict[str, tuple[int, list[TokenLogprob]]] = {}
        if scored:  # the grid's every token's logits: see prompt_logprobs.py
            widened, last = all_rows(inputs)
            every = self.graphs.run(phase, bucket, widened)
            prompt_logprobs = score(every, scored, flat_starts(inputs, new_tokens, packed),
                                    seqs)
            logits = every.index_select(0, last)[: len(seqs)]
        else:
            logits = self.graphs.run(phase, bucket, inputs)[: len(seqs)]
        if self.draft is not None:  # the draft's K/V of the same tokens
            self.draft.mirror(phase, bucket, inputs, seqs, flat_starts(
                inputs, new_tokens, phase is Phase.PREFILL and self.packs_tokens))
        label = bucket_label(phase, bucket)
        rows = batch.sampling_rows  # a prompt chunk short of its end samples nothing
        if not rows:
            return ModelRunnerOutput([], [], label, prompt_logprobs)
        sampled = [seqs[row] for row in rows]
        if len(rows) < len(seqs):
            logits = logits.index_select(0, torch.tensor(rows, device=logits.device))
        sampling = SamplingTensors.build(sampled, self.vocab_size, self.eos_token_ids,
                                         self.platform.device, token_bitmask)
        out = self.sampler(logits, sampling)
        self.graphs.sync(SyncPoint.SAMPLER)
        return ModelRunnerOutput(out.token_ids.tolist(), to_token_logprobs(out, sampled), label,
                                 prompt_logprobs)

    def _verify(self, batch: ScheduledBatch, new_tokens: list[int],
                token_bitmask: torch.Tensor | None) -> ModelRunnerOutput:
        """A speculative verify step: each row's last token and drafts in one forward (a
        decode bucket of query ``k + 1``; rows with fewer drafts padded), the target's
        logits at every position, then acceptance (see rejection.py)."""
        assert batch.spec_token_ids is not None and self.spec_query is not None
        seqs, drafts = batch.seqs, batch.spec_token_ids
        phase = Phase.DECODE
        q = self.spec_query
        bs, size = len(seqs), sum(len(s.block_table) for s in seqs)
        self.counters.observed.record(phase, exact_bucket(phase, bs, size, 0, q),
                                      sum(new_tokens))
        bucket = (self.shapes.pad(phase, bs, size, 0, q) if self.shapes is not None
                  else exact_bucket(phase, bs, size, 0, q))
        if self.packs_tokens:
            inputs = self.inputs.packed(seqs, new_tokens, drafts)
        else:
            inputs = self.inputs.verify(seqs, drafts, (bucket.batch, q, bucket.blocks))
        if self.lora is not None:
            inputs = self._with_lora(inputs, seqs, new_tokens, self.packs_tokens)
        self.counters.tokens(phase, sum(new_tokens), inputs.input_ids.numel())
        logits = self.graphs.run(phase, bucket, inputs)
        if self.draft is not None:  # the last token's and the drafts' K/V in the draft
            self.draft.mirror(phase, bucket, inputs, seqs,
                              flat_starts(inputs, new_tokens, self.packs_tokens))
        if not self.packs_tokens:  # the real rows of the [bs, q] grid
            index = [row * q + j for row, n in enumerate(new_tokens) for j in range(n)]
            logits = logits.index_select(0, torch.tensor(index, device=logits.device))
        rows = verify_rows(seqs, drafts, self.platform.device)
        if token_bitmask is not None:  # guided sequences draft nothing: one row each
            token_bitmask = token_bitmask.repeat_interleave(
                torch.tensor(new_tokens, device=token_bitmask.device), dim=0)
        sampling = SamplingTensors.build(rows, self.vocab_size, self.eos_token_ids,
                                         self.platform.device, token_bitmask)
        runs, logprobs = verify(self.sampler, logits, seqs, drafts, rows, sampling)
        self.graphs.sync(SyncPoint.SAMPLER)
        return ModelRunnerOutput([run[0] for run in runs], [lp[0] for lp in logprobs],
                                 bucket_label(phase, bucket), runs=runs, run_logprobs=logprobs)

    def _with_lora(self, inputs: ForwardInputs, seqs: list[Sequence], new_tokens: list[int],
                   packed: bool) -> ForwardInputs:
        """The inputs with each token's adapter slot (pad rows: 0), the batch's adapters
        copied into slots first where they are not there yet."""
        assert self.lora is not None
        rows = self.lora.slots_for(s.lora for s in seqs)
        if not any(rows) and not self.graphs.needs_warmup:
            return inputs  # eager and no adapter in the step: the model skips LoRA
        if packed:
            slots = torch.repeat_interleave(torch.tensor(rows), torch.tensor(new_tokens))
        else:
            bs, q = inputs.input_ids.shape
            slots = torch.tensor(rows + [0] * (bs - len(rows))).repeat_interleave(q)
        return dataclasses.replace(inputs, lora_slots=slots.to(self.platform.device))

    def _with_images(self, inputs: ForwardInputs, seqs: list[Sequence],
                     new_tokens: list[int], packed: bool) -> ForwardInputs:
        """A vision-language prefill: the encoder phase (the images its chunks reach,
        encoded or found in the cache), then their rows in place of the placeholders'
        embeddings. Every prefill carries the rows, image or not: one graph per bucket."""
        assert self.vision is not None
        starts = flat_starts(inputs, new_tokens, packed)
        total = inputs.input_ids.numel()
        embeds, mask = self.vision.rows(seqs, new_tokens, starts, total)
        inputs = dataclasses.replace(inputs, mm_embeds=embeds, mm_mask=mask)
        # Gemma 3: its image tokens see each other; every prefill graph takes the ends
        # (zeros without images), while eager steps without images skip the mask
        if self.graphs.needs_warmup or self._bidirectional_step(seqs, new_tokens):
            ends = self.vision.image_ends(seqs, new_tokens, starts, total)
            if ends is not None:
                inputs.meta = dataclasses.replace(inputs.meta, image_ends=ends)
        return inputs

    def _bidirectional_step(self, seqs: list[Sequence], new_tokens: list[int]) -> bool:
        """Whether a prefill's chunks reach image tokens that attend to each other both
        ways (Gemma 3): such a step is never packed (the fused kernel's rows see a causal
        prefix only; the padded grid's masked attention runs instead)."""
        if self.vision is None or not self.vision.vision.config.bidirectional:
            return False
        return any(span.offset < seq.num_computed_tokens + n
                   and seq.num_computed_tokens < span.end
                   for seq, n in zip(seqs, new_tokens) for span in seq.images)

    def _dummy(self, phase: Phase, bucket: Bucket) -> ForwardInputs:
        """Warmup inputs of a bucket; with LoRA, a slot per token (graphs take them); for a
        vision model's prefills, blank image rows."""
        inputs = self.inputs.dummy(phase, bucket)
        if self.vision is not None and phase is Phase.PREFILL:
            inputs = self._with_images(inputs, [], [], False)
        if self.lora is None:
            return inputs
        return dataclasses.replace(inputs, lora_slots=torch.zeros(
            inputs.input_ids.numel(), dtype=torch.long, device=self.platform.device))

    def _bucket(self, phase: Phase, seqs: list[Sequence], new_tokens: list[int]) -> Bucket:
        """The planned bucket that holds the batch, or its exact shape when bucketing is off
        or the batch fits no bucket (then counted as a miss)."""
        ctx = 0
        if phase is Phase.PREFILL:
            bs, size = len(seqs), max(new_tokens)
            ctx = max(-(-s.num_computed_tokens // self.block_size) for s in seqs)
        else:
            bs, size = len(seqs), sum(len(s.block_table) for s in seqs)
        # every step's unpadded shape, bucketing on or off: the traffic a plan is fitted to
        self.counters.observed.record(phase, exact_bucket(phase, bs, size, ctx),
                                      sum(new_tokens))
        if self.shapes is None:
            return exact_bucket(phase, bs, size, ctx)
        return self.shapes.pad(phase, bs, size, ctx)

    def warmup(self) -> float:
        """Runs (compiles / captures) every planned bucket and the sampler before serving;
        returns the seconds spent."""
        buckets = self.shapes.buckets if self.shapes is not None else {p: [] for p in Phase}
        hooks = WarmupHooks(self._dummy, self.warm_sampler,
                            lambda: self.platform.free_memory_bytes()[0])
        logger.info("Execution mode: %s", self.graphs.description)
        began = time.monotonic()
        with torch.inference_mode():
            if self.vision is not None and not self.warmup_config.skip:
                self.vision.warmup()  # before run_warmup moves the counters to serving
            if self.draft is not None:  # likewise: warmup ends with the counters serving
                self.draft.warm(buckets, self._dummy)
            seconds = run_warmup(buckets, self.graphs, hooks, self.counters, self.warmup_config)
        if self.vision is not None or self.draft is not None:
            seconds = time.monotonic() - began
        self._free_after_warmup = self.platform.free_memory_bytes()[0]
        return seconds

    def between_steps(self) -> None:
        """Adaptive bucketing: maybe warm one more bucket. Called by the engine between
        steps (never inside one), so no request's step waits on a half-built graph."""
        if self.adaptive is None:
            return
        found = self.adaptive.propose()
        if found is None:
            return
        phase, bucket = found
        capture = self.graphs.captures_graphs and self._graph_memory_to_spare()
        if self.graphs.captures_graphs and not capture:
            # graph memory spent: a bucket that cannot be captured is not worth a stall
            return
        began = time.monotonic()
        with self.counters.warming(), torch.inference_mode():  # counted as warmup
            self.graphs.warm(phase, bucket, self._dummy(phase, bucket))
            if capture:
                self.graphs.capture(phase, bucket, self._dummy(phase, bucket))
            if self.draft is not None:  # the draft mirrors every target step's bucket
                self.draft.warm({phase: [bucket]}, self._dummy)
        self.counters.observed.warmed(phase, bucket, time.monotonic() - began)
        self.adaptive.added(phase, bucket)

    def sleep(self, level: SleepLevel) -> None:
        """Frees the KV cache, and the weights (level 1: kept in host memory; level 2:
        dropped). Call between steps, with no sequence holding KV blocks."""
        memory = self._sleep_memory()
        with memory.freeing():
            memory.release_kv()
            if level is SleepLevel.DISCARD:
                memory.discard_weights()
            else:
                memory.offload_weights()
        self._graphs_stale = self.graphs.captures_graphs

    def wake_up(self, tags: frozenset[WakeTag]) -> None:
        """Restores what ``tags`` name: the weights (from host memory, or from the files
        after level 2), the KV cache (empty, zero-filled). Graphs are re-captured once both
        are back, where they were captured."""
        memory = self._sleep_memory()
        if WakeTag.WEIGHTS in tags:
            if memory.needs_files:
                assert self.weight_loader is not None
                memory.load_weights(self.weight_loader.load(self.weight_loader.path).model)
                memory.release_to_system()  # the fresh model's copy
            else:
                memory.restore_weights()
        if WakeTag.KV_CACHE in tags:
            memory.restore_kv()
        self._recapture_if_stale()

    def reload_weights(self, path: str) -> None:
        """The weights at ``path`` (the same architecture and shapes) copied into the served
        tensors in place; a WeightMismatchError naming what differs leaves them unchanged.
        Asleep, the weights become resident (the KV cache stays as it is)."""
        memory = self._sleep_memory()
        assert self.weight_loader is not None
        fresh = self.weight_loader.load(path)
        memory.load_weights(fresh.model)
        self.weight_loader.path = path
        del fresh
        memory.release_to_system()
        self._recapture_if_stale()

    def _sleep_memory(self) -> DeviceMemory:
        if self.memory is None:
            raise RuntimeError("sleep mode is off (--enable-sleep-mode)")
        return self.memory

    def _recapture_if_stale(self) -> None:
        """Re-records every captured graph once weights and KV cache are back (counted as
        warmup): their storages came back at other addresses."""
        if not self._graphs_stale or self.memory is None or not self.memory.resident:
            return
        with self.counters.warming(), torch.inference_mode():
            for phase, buckets in self.graphs.warmed.items():
                for bucket in sorted(buckets):
                    if self.graphs.can_replay(phase, bucket):
                        self.graphs.capture(phase, bucket, self._dummy(phase, bucket))
        self._graphs_stale = False
        logger.info("Re-captured the device graphs after a wake")

    def _graph_memory_to_spare(self) -> bool:
        """Graphs added while serving may use another VLLM_GRAPH_RESERVED_MEM share of the
        memory that was free after warmup, no more (the KV cache and activations need it)."""
        free = self.platform.free_memory_bytes()[0]
        floor = self._free_after_warmup * (1 - self.warmup_config.graph_reserved_mem)
        return free > 0 and free >= floor

    def warm_sampler(self, bs: int, config: tuple[float, float, int]) -> None:
        """Runs the sampler on random logits with one of the reference's configurations."""
        temperature, top_p, top_k = config
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k or -1,
                                max_tokens=1)
        seqs = [dummy_seq(1, [], params) for _ in range(bs)]
        logits = torch.randn(bs, self.vocab_size, device=self.platform.device)
        with torch.inference_mode():
            self.sampler(logits, SamplingTensors.build(seqs, self.vocab_size,
                                                       self.eos_token_ids, self.platform.device))

    def _num_blocks(self, config: EngineConfig, loaded: LoadedModel,
                    limits: SchedulerLimits, draft_block_bytes: int = 0) -> int:
        """``draft_block_bytes``: a draft model's cache holds every block too."""
        cache = config.cache
        if cache.num_blocks_override is not None:
            return cache.num_blocks_override
        per_block = (loaded.config.kv_layout.bytes_per_block(cache.block_size, self.kv_dtype)
                     + draft_block_bytes)
        per_seq = blocks_for(limits.max_model_len, cache.block_size)
        budget = self.platform.kv_cache_budget_bytes(cache)
        if self.vision is not None:  # the encoder's working memory at its largest bucket
            encoder = self.vision.activation_bytes()
            logger.info("Vision encoder activations: %.1f MiB kept out of the KV cache",
                        encoder / 2**20)
            budget -= encoder
        # No use holding more than every sequence at full length. The state cache (hybrid
        # models) comes out of the same budget.
        if self.state is not None:
            budget = self.state.kv_budget(budget, per_block)
        return num_kv_blocks(budget, per_block, limits.max_num_seqs * per_seq, per_seq)


def bucket_label(phase: Phase, bucket: Bucket) -> str:
    """How a request's trace names a step's bucket: ``prefill:1,128,0``."""
    return f"{phase.value}:{bucket.batch},{bucket.query},{bucket.blocks}"


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """``--kv-cache-dtype``: ``auto`` keeps the model's dtype; ``fp8`` / ``fp8_e4m3`` store
    float8 e4m3 (unscaled, as vLLM does without calibrated scales: K/V values of these models
    sit well inside its +-448 range)."""
    if name == "auto":
        return model_dtype
    if name in ("fp8", "fp8_e4m3"):
        return torch.float8_e4m3fn
    raise ValueError(f"--kv-cache-dtype {name!r}: auto, fp8 or fp8_e4m3")
