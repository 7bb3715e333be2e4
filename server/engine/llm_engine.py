"""The synchronous engine core: ``add_request`` / ``abort_request`` / ``step``."""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

import torch

from server.config import EngineConfig
from server.engine.block_manager import BlockManager, blocks_for
from server.engine.detokenizer import IncrementalDetokenizer
from server.engine.errors import EngineFaultError, RequestError
from server.engine.model_runner import ModelRunner
from server.engine.output_processor import OutputProcessor, RequestState
from server.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from server.engine.sampling_params import SamplingParams
from server.engine.scheduler import Scheduler, SchedulerLimits
from server.engine.sequence import ScheduledBatch, Sequence
from server.engine.tokenizer import Tokenizer
from server.hpu.bucketing import bucketing_config, decode_buckets, format_plan, prompt_buckets
from server.hpu.counters import DeviceCounters
from server.hpu.cpu_kernels import load_cpu_kernels, writable_cache_dir
from server.hpu.cpu_linear import (
    INT4_MAX_ROWS,
    attach_int4_weights,
    int4_supported,
    pack_linear_layers,
)
from server.hpu.graph_runner import select_runner
from server.hpu.kv_cache import allocate_kv_cache, kv_bytes_per_block
from server.hpu.platform import Platform, detect_platform
from server.hpu.shapes import ShapePlanner
from server.hpu.warmup import WarmupHooks, run_warmup
from server.models.gguf_int4 import GROUP_SIZE
from server.models.layer_ops import FusedCpuLayerOps
from server.models.loader import (
    LoadedModel,
    ModelSource,
    load_int4_weights,
    load_model,
    resolve_model_source,
)

logger = logging.getLogger(__name__)

# Consecutive steps in which every request failed before the engine declares a device fault.
MAX_FAILED_STEPS = 3


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot for metrics and health reporting."""

    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_blocks: int
    kv_cache_usage: float
    num_preemptions: int


class LLMEngine:
    """Loads the model, sizes the KV cache, and runs ``step() = schedule -> run -> update``."""

    def __init__(self, config: EngineConfig) -> None:
        torch.manual_seed(config.model.seed)
        self.platform: Platform = detect_platform(config.device.device)
        self.platform.prepare_process()
        self.source: ModelSource = resolve_model_source(config.model.model)
        self.model_name = config.model.served_model_name or self.source.name
        loaded = load_model(self.source, config.model.dtype, self.platform.device)
        self.model_config = loaded.config
        self.cache_dir = writable_cache_dir(config.cache_dir)
        self.tokenizer = Tokenizer.from_model_path(
            self.source.folder, gguf_file=self.source.gguf_file,
            chat_template=config.model.chat_template, cache_dir=self.cache_dir / "tokenizers",
        )
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids) | frozenset(
            loaded.config.eos_token_ids
        )
        self.limits = _resolve_limits(config, loaded)
        self.block_size = config.cache.block_size
        num_blocks = self._num_kv_blocks(config, loaded)
        self.block_manager = BlockManager(num_blocks, self.block_size)
        cfg = loaded.config
        kv_caches = allocate_kv_cache(
            cfg.num_layers, num_blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim,
            loaded.dtype, self.platform.device,
        )
        self.runner = ModelRunner(
            loaded.model, kv_caches, self.block_size, self.block_manager.pad_block_id,
            self.eos_token_ids, self.platform.device,
        )
        self.counters = DeviceCounters(self.model_name)
        self.runner.graphs = select_runner(
            self.platform.name, config.device.execution_mode, config.device.enforce_eager,
            self.runner.forward, self.counters, loaded.model, config.device.hpu_lazy_mode,
        )
        self._prepare_cpu_weights(config, loaded)
        self.bucketing = bucketing_config(
            dict(config.bucketing_env), block_size=self.block_size,
            max_model_len=self.limits.max_model_len, max_num_seqs=self.limits.max_num_seqs,
            max_num_batched_tokens=self.limits.max_num_batched_tokens, num_blocks=num_blocks,
        )
        self.warmup_config = config.warmup
        prefill_fits = None
        # Padding only pays where shapes are compiled or captured; plain eager PyTorch on
        # CPU/CUDA would just compute the padding.
        if self.bucketing.enabled and self.runner.graphs.mode != "eager":
            self.runner.shapes = ShapePlanner(
                prompt_buckets(self.bucketing), decode_buckets(self.bucketing), self.counters)
            budget = self.limits.max_num_batched_tokens
            planner = self.runner.shapes

            def prefill_fits(num_seqs: int, max_tokens: int) -> bool:
                return planner.prefill_fits(num_seqs, max_tokens, budget)

            for line in format_plan(self.bucketing).splitlines():
                logger.info("%s", line)
        self.scheduler = Scheduler(self.limits, self.block_manager, prefill_fits)
        self.output_processor = OutputProcessor(
            self.tokenizer, self.eos_token_ids, self.limits.max_model_len
        )
        self._seq_ids = itertools.count()
        self._failed_steps = 0
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens), max_model_len %d, max_num_seqs %d",
            num_blocks, self.block_size, num_blocks * self.block_size,
            self.limits.max_model_len, self.limits.max_num_seqs,
        )

    def warmup(self) -> float:
        """Runs (compiles / captures) every planned bucket and the sampler; call before
        serving. Returns seconds spent."""
        shapes = self.runner.shapes
        buckets = shapes.buckets if shapes is not None else {"prompt": [], "decode": []}
        hooks = WarmupHooks(self.runner.dummy_inputs, self.runner.warm_sampler,
                            lambda: self.platform.free_memory_bytes()[0])
        logger.info("Execution mode: %s", self.runner.graphs.mode)
        with torch.inference_mode():
            return run_warmup(buckets, self.runner.graphs, hooks, self.counters,
                              self.warmup_config)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Validates and queues a request; raises RequestError if it can never be served."""
        self.enqueue(self.prepare(request_id, prompt, params, arrival_time))

    def prepare(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> RequestState:
        """Tokenizes and validates without touching engine state: safe from any thread."""
        params = params or SamplingParams()
        prompt_text = prompt if isinstance(prompt, str) else None
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        params = self._check_request(prompt_ids, params)
        now = arrival_time if arrival_time is not None else time.monotonic()
        seqs = [
            Sequence(next(self._seq_ids), request_id, i, prompt_ids, params, now)
            for i in range(params.n)
        ]
        return RequestState(
            request_id, prompt_text, prompt_ids, params, seqs,
            [self._detokenizer(prompt_ids, params) for _ in seqs],
            [CompletionOutput(i, logprobs=[] if params.logprobs is not None else None)
             for i in range(params.n)],
            RequestMetrics(arrival_time=now),
        )

    def enqueue(self, state: RequestState) -> None:
        """Queues a prepared request (engine thread only)."""
        if state.request_id in self.output_processor.requests:
            raise RequestError(f"request id {state.request_id!r} is already in use", "request_id")
        self.output_processor.add(state)
        for seq in state.seqs:
            self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stops a request wherever it is and frees its blocks; its final output or None."""
        self.scheduler.abort(request_id)
        return self.output_processor.abort(request_id)

    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if batch is None or not batch.seqs:
            return []
        for seq in batch.seqs:
            metrics = self.output_processor.requests[seq.request_id].metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = time.monotonic()
        try:
            result = self.runner.execute(batch)
        except Exception as exc:
            return self._isolate_failure(batch, exc)
        self._failed_steps = 0
        return self.output_processor.process(batch, result, self.scheduler)

    def _isolate_failure(self, batch: ScheduledBatch, exc: Exception) -> list[RequestOutput]:
        """A step raised: run each request of the batch on its own, so that a fault tied to
        one request ends that request only. Re-running is safe: nothing was committed (the
        KV slots are rewritten with the same values). Steps in which nothing succeeds point
        at the device, not at a request; after a few in a row the engine gives up."""
        by_request: dict[str, list[Sequence]] = {}
        for seq in batch.seqs:
            by_request.setdefault(seq.request_id, []).append(seq)
        outputs: list[RequestOutput] = []
        succeeded = False
        for request_id, seqs in by_request.items():
            error: Exception = exc
            if len(by_request) > 1:
                sub = ScheduledBatch(batch.phase, seqs)
                try:
                    result = self.runner.execute(sub)
                except Exception as sub_exc:  # noqa: BLE001 - this request's own fault
                    error = sub_exc
                else:
                    succeeded = True
                    outputs += self.output_processor.process(sub, result, self.scheduler)
                    continue
            self.scheduler.abort(request_id)
            failure = self.output_processor.fail(request_id, error)
            if failure is not None:
                outputs.append(failure)
        self._failed_steps = 0 if succeeded else self._failed_steps + 1
        if self._failed_steps >= MAX_FAILED_STEPS:
            raise EngineFaultError(
                f"{self._failed_steps} engine steps in a row failed for every request in "
                f"them; last error: {exc!r}") from exc
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            self.scheduler.num_running, self.scheduler.num_waiting, bm.num_free_blocks,
            bm.num_blocks, bm.usage, self.scheduler.num_preemptions,
        )

    def _check_request(self, prompt_ids: list[int], params: SamplingParams) -> SamplingParams:
        max_len = self.limits.max_model_len
        if not prompt_ids:
            raise RequestError("the prompt is empty", "prompt")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise RequestError(f"prompt token ids must be in [0, {vocab})", "prompt")
        if params.logit_bias and any(not 0 <= t < vocab for t in params.logit_bias):
            raise RequestError(f"logit_bias token ids must be in [0, {vocab})", "logit_bias")
        if any(not 0 <= t < vocab for t in params.stop_token_ids):
            raise RequestError(f"stop_token_ids must be in [0, {vocab})", "stop_token_ids")
        n_prompt = len(prompt_ids)
        if n_prompt >= max_len:
            raise RequestError(
                f"This model's maximum context length is {max_len} tokens, but the prompt has "
                f"{n_prompt} tokens (at least one token must be left to generate).", "prompt",
            )
        if params.max_tokens is None:
            params = params.model_copy(update={"max_tokens": max_len - n_prompt})
        elif n_prompt + params.max_tokens > max_len:
            raise RequestError(
                f"This model's maximum context length is {max_len} tokens. However, you "
                f"requested {n_prompt + params.max_tokens} tokens ({n_prompt} in the prompt, "
                f"{params.max_tokens} for the completion). Please reduce the prompt or max_tokens.",
                "max_tokens",
            )
        assert params.max_tokens is not None
        needed = blocks_for(n_prompt + params.max_tokens, self.block_size)
        if needed > self.block_manager.num_blocks:
            raise RequestError(
                f"the request needs {needed} KV blocks but the cache has only "
                f"{self.block_manager.num_blocks}", "max_tokens",
            )
        return params

    def _detokenizer(self, prompt_ids: list[int], params: SamplingParams) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(
            self.tokenizer, prompt_ids, skip_special_tokens=params.skip_special_tokens,
            stop=params.stop, include_stop_str_in_output=params.include_stop_str_in_output,
            min_tokens=params.min_tokens,
        )

    def _prepare_cpu_weights(self, config: EngineConfig, loaded: LoadedModel) -> None:
        """Eager CPU: oneDNN-packed linears, a GGUF's own 4-bit weights for small decode
        batches unless ``--quantization none``, and the fused kernels unless disabled."""
        quant = config.model.quantization
        if quant == "gguf" and not self.source.is_gguf:
            raise ValueError("--quantization gguf needs a .gguf model file")
        if self.platform.name != "cpu" or self.runner.graphs.mode != "eager":
            return
        pack_linear_layers(loaded.model)
        if quant != "none" and self.source.is_gguf and int4_supported(loaded.dtype):
            attach_int4_weights(loaded.model, load_int4_weights(self.source, loaded.config),
                                GROUP_SIZE, INT4_MAX_ROWS, loaded.dtype)
        if loaded.dtype not in FusedCpuLayerOps.dtypes:
            logger.info("Fused CPU kernels serve float32 / bfloat16 only: %s runs PyTorch ops",
                        str(loaded.dtype).replace("torch.", ""))
        elif config.device.cpu_kernels and load_cpu_kernels(self.cache_dir / "kernels"):
            self.runner.use_layer_ops(FusedCpuLayerOps())
            logger.info("Layer ops: fused CPU kernels (decode attention reads KV blocks in "
                        "place)")

    def _num_kv_blocks(self, config: EngineConfig, loaded: LoadedModel) -> int:
        cache = config.cache
        if cache.num_blocks_override is not None:
            return cache.num_blocks_override
        cfg = loaded.config
        per_block = kv_bytes_per_block(
            cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cache.block_size, loaded.dtype
        )
        if self.platform.name == "cpu":
            budget = cache.cpu_kvcache_space_bytes
        else:
            free, total = self.platform.free_memory_bytes()
            budget = int(free - total * (1.0 - cache.gpu_memory_utilization))
        # No use holding more than every sequence at full length, plus the pad block.
        useful = self.limits.max_num_seqs * blocks_for(self.limits.max_model_len, cache.block_size)
        num_blocks = min(budget // per_block - 1, useful)
        if num_blocks < blocks_for(self.limits.max_model_len, cache.block_size):
            raise RuntimeError(
                f"KV cache budget ({budget / 2**30:.2f} GiB) holds {max(num_blocks, 0)} blocks, "
                f"fewer than one sequence of max_model_len {self.limits.max_model_len} needs; "
                "raise the budget (VLLM_CPU_KVCACHE_SPACE / --gpu-memory-utilization) "
                "or lower --max-model-len"
            )
        return num_blocks


def _resolve_limits(config: EngineConfig, loaded: LoadedModel) -> SchedulerLimits:
    sched = config.scheduler
    model_max = loaded.config.max_position_embeddings
    max_model_len = sched.max_model_len or model_max
    if max_model_len > model_max:
        raise ValueError(f"--max-model-len {max_model_len} exceeds the model's {model_max}")
    # Without chunked prefill a whole prompt must fit one step's token budget.
    max_batched = sched.max_num_batched_tokens or max(max_model_len, 2048)
    if max_batched < max_model_len:
        raise ValueError(
            f"--max-num-batched-tokens ({max_batched}) must be >= --max-model-len "
            f"({max_model_len}) since prompts are not chunked"
        )
    return SchedulerLimits(sched.max_num_seqs, max_batched, max_model_len)
