"""The synchronous engine core: ``add_request`` / ``abort_request`` / ``step``."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from server.cache_dir import writable_cache_dir
from server.config import EngineConfig, ModelOptions, SpecMethod, SpeculativeSettings
from server.engine.core.block_manager import BlockManager
from server.engine.core.scheduler import Scheduler, Speculation
from server.engine.core.sequence import ScheduledBatch
from server.engine.core.state_cache import StateSlots
from server.engine.errors import RequestError
from server.engine.executor import FaultListener, RankExecutor, make_executor
from server.engine.failures import RequestIsolation
from server.engine.input_processor import InputProcessor
from server.engine.iteration_stats import IterationTokens
from server.engine.lora.registry import LoRARegistry
from server.engine.lora.request import LoRARequest
from server.engine.multimodal.inputs import VisionInfo
from server.engine.multimodal.prompts import image_prompts
from server.engine.output_processor import OutputProcessor, ProcessedStep
from server.engine.outputs import EngineStats, ModelRunnerOutput, RequestOutput
from server.engine.request_state import RequestState
from server.engine.sampling_defaults import SamplingDefaults
from server.engine.sampling_params import SamplingParams
from server.engine.sleep import ALL_TAGS, SleepLevel, WakeTag
from server.engine.sleeper import Sleeper
from server.engine.spec_decode.ngram import NgramProposer
from server.engine.spec_decode.stats import SpecDecodeStats
from server.engine.structured_outputs.backend import StructuredOutputs
from server.engine.tokenizer import Tokenizer
from server.engine.worker.builder import build_model_runner
from server.hpu.counters import DeviceCounters
from server.hpu.distributed import SINGLE
from server.hpu.platform import Platform, detect_platform
from server.models.generation_config import generation_defaults
from server.models.hub import with_local_model
from server.models.loader import (
    ModelSource,
    gguf_parse,
    load_model,
    load_model_config,
    resolve_model_source,
)
from server.models.lora import AdapterError

logger = logging.getLogger(__name__)

class LLMEngine:
    """Assembly of the engine core: ``step() = schedule -> run -> process outputs``.

    The model runner owns the device (weights, KV cache, graphs); the scheduler and block
    manager decide which sequences run; the input and output processors turn requests into
    sequences and sampled tokens into outputs.

    ``on_fault``: called (from another thread) if a part of the engine outside the calling
    thread dies while serving (a tensor-parallel worker rank); the engine is dead then.
    """

    def __init__(self, config: EngineConfig, on_fault: FaultListener | None = None) -> None:
        torch.manual_seed(config.model.seed)
        config = with_local_model(config)  # a Hub id: its cached copy, for every rank
        platform = detect_platform(config.device.device)
        platform.prepare_process()
        # --tensor-parallel-size: the other ranks start first and load alongside this one
        self.executor: RankExecutor | None = None
        if config.parallel.tensor_parallel_size > 1:
            self.executor = make_executor(config, platform, on_fault)
        try:
            self._build(config, platform)
        except BaseException:
            if self.executor is not None:  # workers may sit in a collective: no orders
                self.executor.kill()
            raise

    def _build(self, config: EngineConfig, platform: Platform) -> None:
        parallel = self.executor.parallel if self.executor is not None else SINGLE
        source = resolve_model_source(config.model.model)
        _parse = gguf_parse(source)  # for the reads below; freed when the build returns
        quantization = config.model.quantization
        if quantization == "gguf" and not source.is_gguf:
            raise ValueError("--quantization gguf needs a .gguf model file")
        if quantization not in (None, "none", "gguf"):  # checked before the slow part
            quant = load_model_config(source).quant
            found = quant.method if quant is not None else "not quantized"
            if quantization != found:
                raise ValueError(f"--quantization {quantization}: the checkpoint is {found} "
                                 "(config.json's quantization_config)")
        # read before the weights: a bad generation config stops start-up in a second
        self.sampling_defaults = sampling_defaults_of(config.model, source)
        loaded = load_model(source, config.model.dtype, platform.device, parallel)
        cache_dir = writable_cache_dir(config.cache_dir)
        self.model_name = config.model.served_model_name or source.name
        self.model_config = loaded.config
        self.tokenizer = Tokenizer.from_model_path(
            source.folder, gguf_file=source.gguf_file,
            chat_template=config.model.chat_template, cache_dir=cache_dir / "tokenizers",
        )
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids) | frozenset(
            loaded.config.eos_token_ids)
        # a vision-language model: its processor (before warmup: settings it refuses stop
        # start-up early), and what the API needs to know of it
        mm = config.multimodal
        self.vision: VisionInfo | None = None
        images = None
        if loaded.vision is not None:
            images = image_prompts(source.folder, loaded.vision.config, mm.image_limit,
                                   mm.processor_kwargs)
            self.vision = VisionInfo(mm.image_limit, mm.allowed_local_media_path,
                                     mm.image_fetch_timeout, mm.max_image_bytes,
                                     mm.max_image_pixels)
        elif mm.processor_kwargs:
            logger.warning("--mm-processor-kwargs: ignored, %s takes no images", source.name)
        self.runner = build_model_runner(
            config, platform, source, loaded, parallel, self.eos_token_ids,
            self.executor.broadcasting if self.executor is not None else None,
            self.executor.broadcasting_lora if self.executor is not None else None)
        self.limits = self.runner.limits  # resolved once, as on every other rank
        block_size = config.cache.block_size
        self.block_manager = BlockManager(self.runner.num_blocks, block_size,
                                          self.runner.prefix_caching)
        # hybrid models: which running sequence holds which state slot
        state = self.runner.state
        self.state_slots = StateSlots(state.num_slots) if state is not None else None
        assert self.block_manager.pad_block_id == self.runner.pad_block_id
        spec = config.speculative.settings
        self.spec_stats = (SpecDecodeStats(spec.num_speculative_tokens)
                           if spec is not None else None)
        self.scheduler = Scheduler(self.limits, self.block_manager,
                                   self.runner.prefill_fits if self.runner.shapes else None,
                                   fuse_decodes=self.runner.packs_tokens,
                                   max_loras=(config.lora.max_loras
                                              if config.lora.enable_lora else None),
                                   speculation=self._speculation(spec),
                                   state_slots=self.state_slots)
        # --enable-lora: the adapters served by name (--lora-modules, /v1/load_lora_adapter)
        self.lora_config = config.lora
        self.loras = LoRARegistry()
        for module in config.lora.modules:
            request = self.loras.new_request(module.name, module.path, module.base_model_name)
            self.add_lora(request)
            self.loras.add(request)
        self._structured: StructuredOutputs | None = None
        self._structured_config = config.structured_outputs
        self._structured_lock = threading.Lock()
        self.input_processor = InputProcessor(self.tokenizer, loaded.config.vocab_size,
                                              self.limits, block_size, self.runner.num_blocks,
                                              self.structured_outputs, images)
        self.output_processor = OutputProcessor(self.tokenizer, self.eos_token_ids,
                                                self.limits.max_model_len)
        self.failures = RequestIsolation(self.scheduler, self.output_processor, self._run,
                                         self.stats)
        self._iteration_tokens = IterationTokens(self.model_name, self.counters.registry,
                                                 self.limits.max_num_batched_tokens)
        self.sleep_mode = config.device.enable_sleep_mode
        self.sleeper = Sleeper(self.sleep_mode, self.executor is not None, self.runner,
                               self.block_manager, self._abort_all)
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens), %s, %.1f MiB, max_model_len %d, "
            "max_num_seqs %d", self.runner.num_blocks, block_size,
            self.runner.num_blocks * block_size,
            str(self.runner.kv_dtype).replace("torch.", ""), self.runner.kv_cache_bytes / 2**20,
            self.limits.max_model_len, self.limits.max_num_seqs,
        )

    def structured_outputs(self) -> StructuredOutputs:
        """The grammar backend, built on the first guided request (thread-safe: requests
        are prepared in worker threads)."""
        with self._structured_lock:
            if self._structured is None:
                self._structured = StructuredOutputs(
                    self.tokenizer.hf, self.model_config.vocab_size,
                    sorted(self.eos_token_ids), self._structured_config)
            return self._structured

    @property
    def counters(self) -> DeviceCounters:
        """The device layer's Prometheus series (compilations, bucket misses, padding)."""
        return self.runner.counters

    def warmup(self) -> float:
        """Runs (compiles / captures) every planned bucket and the sampler; call before
        serving. Returns seconds spent."""
        return self.runner.warmup()

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        client: str = "",
        lora_request: LoRARequest | None = None,
        images: Sequence[Any] = (),
    ) -> None:
        """Validates and queues a request; raises RequestError if it can never be served.
        ``images``: the prompt's images (PIL), one per image placeholder token."""
        self.enqueue(self.prepare(request_id, prompt, params, arrival_time, client,
                                  lora_request=lora_request, images=images))

    def prepare(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        client: str = "",
        grammar: bool = True,
        lora_request: LoRARequest | None = None,
        images: Sequence[Any] = (),
    ) -> RequestState:
        """Tokenizes and validates without touching engine state: safe from any thread.
        ``grammar=False``: the constraint is only checked, for the caller to compile
        (``input_processor.start_grammar``) without holding this thread."""
        if lora_request is not None:  # read and checked here, off the engine thread
            self.add_lora(lora_request)
        return self.input_processor.process(request_id, prompt, params, arrival_time, client,
                                            grammar, lora_request, images)

    def enqueue(self, state: RequestState) -> None:
        """Queues a prepared request (engine thread only)."""
        self.sleeper.check_awake()
        if state.request_id in self.output_processor.requests:
            raise RequestError(f"request id {state.request_id!r} is already in use", "request_id")
        self.output_processor.add(state)
        for seq in state.seqs:
            self.scheduler.add(seq)

    def add_lora(self, request: LoRARequest) -> None:
        """Reads and checks an adapter into host memory (any thread: the device slots are
        filled by the step that needs it); a RequestError names what is wrong with it."""
        if self.runner.lora is None:
            raise RequestError("LoRA adapters are not enabled (--enable-lora)", "model")
        try:
            self.runner.lora.load(request)
        except AdapterError as exc:
            raise RequestError(str(exc), "lora_path") from None

    def remove_lora(self, adapter_id: int) -> None:
        """Drops an adapter's host copy and device slot (engine thread)."""
        if self.runner.lora is not None:
            self.runner.lora.remove(adapter_id)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stops a request wherever it is and frees its blocks; its final output or None."""
        self.scheduler.abort(request_id)
        return self.output_processor.abort(request_id)

    def step(self) -> list[RequestOutput]:
        """One scheduling round: its batches (a decode and a prefill with chunked prefill,
        one of them otherwise) run back to back."""
        outputs: list[RequestOutput] = []
        tokens: list[int] = []
        batches = self.scheduler.schedule()
        if not batches and self.scheduler.has_unfinished():
            return self.failures.unplaceable()
        for batch in batches:
            # an earlier batch of this step may have ended a request (a failure)
            live = [seq for seq in batch.seqs if not seq.is_finished]
            if not live:
                continue
            batch = batch if len(live) == len(batch.seqs) else batch.subset(live)
            tokens.append(IterationTokens.tokens(batch))
            outputs += self._step_batch(batch)
        self._iteration_tokens.observe(tokens)
        self.runner.between_steps()  # adaptive bucketing warms here, outside any step
        return outputs

    def _step_batch(self, batch: ScheduledBatch) -> list[RequestOutput]:
        for seq in batch.seqs:
            metrics = self.output_processor.requests[seq.request_id].metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = time.monotonic()
                metrics.num_cached_tokens = seq.num_cached_tokens
        try:
            sampled, result = self._execute(batch)
        except Exception as exc:
            return self.failures.isolate(batch, exc)
        self.failures.step_ran()
        return self._retire(self.output_processor.process(sampled, result), batch)

    def _run(self, batch: ScheduledBatch) -> list[RequestOutput]:
        """Executes a batch and retires what it finished (a request run alone after its
        batch failed)."""
        sampled, result = self._execute(batch)
        return self._retire(self.output_processor.process(sampled, result), batch)

    def _execute(self, batch: ScheduledBatch) -> tuple[ScheduledBatch, ModelRunnerOutput]:
        """Runs the batch, with the allowed-token mask of its guided sequences; returns the
        part of it that sampled (a prompt chunk short of its end samples nothing) and the
        tokens."""
        rows = batch.sampling_rows
        sampled = batch if len(rows) == len(batch.seqs) else batch.subset(
            [batch.seqs[row] for row in rows])
        bitmask = None
        if self._structured is not None and sampled.seqs:
            bitmask = self._structured.bitmask([s.grammar for s in sampled.seqs])
        result = self.runner.execute(batch, bitmask)
        requests = self.output_processor.requests
        for seq in batch.seqs:  # what its trace tells: the buckets the request ran in
            requests[seq.request_id].metrics.ran_in(result.bucket)
        accepted = None
        if batch.spec_token_ids is not None:  # a verify step: keep the accepted drafts' K/V
            accepted = result.num_accepted
            if self.spec_stats is not None:
                self.spec_stats.observe(batch.spec_token_ids, accepted)
        self.scheduler.advance(batch, accepted)
        if self.block_manager.enable_caching:
            for seq in batch.seqs:  # their K/V are in the cache now: full blocks can be shared
                # (accepted drafts join the tokens after this step: named at the next one)
                self.block_manager.cache_blocks(
                    seq, min(seq.num_computed_tokens, seq.num_tokens))
        return sampled, result

    def _retire(self, processed: ProcessedStep,
                batch: ScheduledBatch | None = None) -> list[RequestOutput]:
        """Frees what the step finished: stopped sequences, and failed requests whole; after
        a verify step, the blocks only rejected drafts were written to."""
        for seq in processed.finished:
            self.scheduler.finish(seq)
        for request_id in processed.failed:
            self.scheduler.abort(request_id)
        if batch is not None and batch.spec_token_ids is not None:
            for seq in batch.seqs:
                if not seq.is_finished:
                    self.block_manager.trim(seq)
        return processed.outputs

    def request_ids(self) -> list[str]:
        """Every request the engine holds (waiting or running)."""
        return list(self.output_processor.requests)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            self.scheduler.num_running, self.scheduler.num_waiting, bm.num_free_blocks,
            bm.num_blocks, bm.usage, self.scheduler.num_preemptions,
            bm.stats.queries, bm.stats.hits, *self._lora_stats(), *self._spec_stats(),
            sleep_level=int(self.sleeper.level) if self.sleeper.level is not None else 0,
        )

    def _speculation(self, spec: SpeculativeSettings | None) -> Speculation | None:
        """The scheduler's proposer: prompt lookup, or the runner's draft model (or EAGLE /
        MTP head)."""
        if spec is None:
            return None
        if spec.method is not SpecMethod.NGRAM:
            assert self.runner.draft is not None
            propose = self.runner.draft.propose
        else:
            propose = NgramProposer(spec).propose_batch
        return Speculation(propose, spec.num_speculative_tokens, spec.disable_by_batch_size)

    def _spec_stats(self) -> tuple[int, int, int, tuple[int, ...]]:
        s = self.spec_stats
        if s is None:
            return 0, 0, 0, ()
        return (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens,
                tuple(s.accepted_per_pos))

    def _lora_stats(self) -> tuple[tuple[str, ...], tuple[str, ...], int]:
        if self.scheduler.max_loras is None:
            return (), (), 0
        running = {s.lora.lora_name for s in self.scheduler.running if s.lora is not None}
        waiting = {s.lora.lora_name for s in list(self.scheduler.waiting)
                   if s.lora is not None}
        return tuple(sorted(running)), tuple(sorted(waiting)), self.scheduler.max_loras

    def shutdown(self, graceful: bool = True) -> None:
        """Stops the other tensor-parallel ranks: told to stop when ``graceful`` (call it
        once no step runs), else killed."""
        if self.executor is not None:
            self.executor.shutdown(graceful)
        if self._structured is not None:  # its compile worker processes
            self._structured.close()

    def reset_prefix_cache(self) -> int:
        """Forgets every cached prefix; the number of blocks that were named."""
        return self.block_manager.reset_prefix_cache()

    @property
    def is_sleeping(self) -> bool:
        return self.sleeper.is_sleeping

    def sleep(self, level: SleepLevel) -> list[RequestOutput]:
        """Engine thread only, between steps (``Sleeper.sleep``)."""
        return self.sleeper.sleep(level)

    def wake_up(self, tags: frozenset[WakeTag] = ALL_TAGS) -> None:
        self.sleeper.wake_up(tags)

    def reload_weights(self, path: str) -> None:
        """Between steps: running requests go on with the new weights."""
        self.sleeper.reload_weights(path)

    def _abort_all(self) -> list[RequestOutput]:
        return [out for out in map(self.abort_request, self.request_ids()) if out is not None]


def sampling_defaults_of(options: ModelOptions, source: ModelSource) -> SamplingDefaults:
    """The request defaults ``--generation-config`` gives, logged once as vLLM logs them."""
    found, where = generation_defaults(options.generation_config, source.folder,
                                       gguf_parse(source), options.generation_overrides)
    defaults = SamplingDefaults.from_fields(found, where)
    if defaults.as_dict():
        logger.warning("Default sampling parameters have been overridden by the model's "
                       "generation config (%s): %s. Requests that leave these fields unset "
                       "get them; relaunch with `--generation-config vllm` if this is not "
                       "intended.", where, defaults.as_dict())
    else:
        logger.info("Default sampling parameters: the API's own (none from %s)", where)
    return defaults
