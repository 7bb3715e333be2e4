"""The engine core of a pooling model, with the synchronous interface ``AsyncEngine`` drives
(``prepare`` / ``enqueue`` / ``step`` / ``abort_request``...): one forward pass per request,
batched in planned buckets, no KV cache."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from server.cache_dir import writable_cache_dir
from server.config import Convert, EngineConfig, ExecutionMode, SchedulerLimits
from server.engine.errors import RequestError
from server.engine.failures import FailedSteps
from server.engine.outputs import EngineStats, RequestMetrics
from server.engine.pooling.outputs import PoolingRequestOutput
from server.engine.pooling.params import PoolingModelInfo, PoolingParams, PoolingTask
from server.engine.pooling.pooler import finish
from server.engine.pooling.runner import EncoderRow, PoolingRunner
from server.engine.pooling.scheduler import PoolingRequest, PoolingScheduler
from server.engine.sleep import ALL_TAGS, SleepLevel, WakeTag
from server.engine.tokenizer import Tokenizer
from server.hpu.buckets.pooling import pooling_buckets
from server.hpu.counters import DeviceCounters
from server.hpu.cpu.kernels import load_cpu_kernels
from server.hpu.platform import detect_platform
from server.models.encoders.bert import BertEncoder
from server.models.encoders.load import load_pooling_model
from server.models.encoders.modernbert import ModernBertEncoder
from server.models.loader import resolve_model_source

logger = logging.getLogger(__name__)

class _NoGrammar:
    """Pooling requests carry no grammar (the async engine asks every request)."""

    def start_grammar(self, state: object, client: str = "") -> None:
        del state, client


def _dtype(requested: str, folder: str, device: torch.device) -> torch.dtype:
    named = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if requested in named:
        return named[requested]
    try:
        cfg = json.loads(Path(folder, "config.json").read_text())
    except (OSError, ValueError):
        cfg = {}
    found = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
    if found == "float16" and device.type == "cpu":
        return torch.bfloat16  # fp16 matmuls are slow on CPU
    return named.get(found, torch.float32)


class PoolingEngine:
    """``step() = schedule -> one padded forward -> one final output per request``."""

    sleep_mode = False
    is_sleeping = False
    executor = None

    def __init__(self, config: EngineConfig, on_fault: object | None = None) -> None:
        del on_fault  # one process: nothing outside this thread can die
        torch.manual_seed(config.model.seed)
        if config.parallel.tensor_parallel_size > 1:
            raise ValueError("--tensor-parallel-size > 1 is not supported with --runner pooling")
        platform = detect_platform(config.device.device)
        platform.prepare_process()
        source = resolve_model_source(config.model.model)
        if source.is_gguf:
            raise ValueError("--runner pooling needs a Hugging Face folder, not a GGUF file")
        convert = config.pooling.convert
        classify = {Convert.EMBED: False, Convert.CLASSIFY: True,
                    Convert.REWARD: True}.get(convert)
        dtype = _dtype(config.model.dtype, source.folder, platform.device)
        self.tokenizer = Tokenizer.from_model_path(
            source.folder, chat_template=config.model.chat_template,
            cache_dir=writable_cache_dir(config.cache_dir) / "tokenizers")
        self.loaded = load_pooling_model(source.folder, dtype, platform.device, classify,
                                         config.pooling.overrides,
                                         _token_id(self.tokenizer.hf))
        st = self.loaded.st
        self.model_name = config.model.served_model_name or source.name
        model_max = self.loaded.max_tokens
        if st.max_seq_length:  # texts are cut there, as sentence-transformers cuts them
            model_max = min(model_max, st.max_seq_length)
        self.limits = SchedulerLimits.resolve(config.scheduler, model_max,
                                              chunked_prefill=False)
        self.max_seq_length = st.max_seq_length
        mode = platform.resolve_mode(config.device)
        if mode is ExecutionMode.GRAPHS:
            mode = ExecutionMode.COMPILE
        if (mode is ExecutionMode.EAGER and platform.device.type == "cpu"
                and isinstance(self.loaded.model, (BertEncoder, ModernBertEncoder))):
            # inductor packs weights itself when it freezes a graph: only eager needs this
            self._pack_for_cpu(config)
        self.counters = DeviceCounters(self.model_name)
        buckets = pooling_buckets(self.limits.max_model_len, self.limits.max_num_seqs,
                                  self.limits.max_num_batched_tokens)
        self.runner = PoolingRunner(self.loaded, platform.device, mode, self.counters, buckets)
        self.scheduler = PoolingScheduler(self.limits.max_num_seqs,
                                          self.limits.max_num_batched_tokens,
                                          self.runner.bucket_for)
        self.input_processor = _NoGrammar()
        self.info = PoolingModelInfo(
            tasks=frozenset({PoolingTask.CLASSIFY, PoolingTask.SCORE} if self.loaded.classify
                            else {PoolingTask.EMBED, PoolingTask.SCORE}),
            hidden_size=self.loaded.model.cfg.hidden_size,
            num_labels=self.loaded.num_labels,
            matryoshka_dimensions=self.loaded.matryoshka_dimensions,
            max_model_len=self.limits.max_model_len,
            cross_encoder=self.loaded.classify,
            pairs_as_text=self.loaded.pairs_as_text,
            prompts=dict(st.prompts),
            id2label=_id2label(source.folder))
        self.failed_steps = FailedSteps("pooling")
        logger.info("Pooling model: %s pooling, %snormalized, max_model_len %d, %d buckets, "
                    "%s", self.runner.pooling, "" if self.loaded.normalize else "not ",
                    self.limits.max_model_len, len(buckets), mode)

    def warmup(self) -> float:
        return self.runner.warmup()

    def _pack_for_cpu(self, config: EngineConfig) -> None:
        """Eager CPU: packed linears, and for BERT-family encoders the fused attention kernel
        unless ``HPU_SERVE_CPU_KERNELS=0`` or it cannot be built (PyTorch's attention then)."""
        model = self.loaded.model
        if isinstance(model, ModernBertEncoder):
            model.pack_for_cpu()  # local attention windows: PyTorch's masked attention
            return
        assert isinstance(model, BertEncoder), type(model)
        kernel = config.device.cpu_kernels and load_cpu_kernels(
            writable_cache_dir(config.cache_dir) / "kernels")
        model.pack_for_cpu(attention_kernel=kernel)
        used = model.encoder.layer[0].attention.self.kernel  # supported dtype and head size
        logger.info("Encoder attention: %s", "fused CPU kernel" if used
                    else "PyTorch scaled_dot_product_attention")

    # -- requests ---------------------------------------------------------------------------

    def prepare(self, request_id: str, prompt: str | list[int],
                params: PoolingParams | None = None, arrival_time: float | None = None,
                client: str = "", grammar: bool = True,
                lora_request: object | None = None) -> PoolingRequest:
        """Tokenizes and checks a request (any thread). Pooling serves no LoRA adapters:
        the API never resolves one here (``lora_request`` stays None)."""
        del grammar
        if lora_request is not None:
            raise RequestError("LoRA adapters are not served by the pooling runner", "model")
        params = params if isinstance(params, PoolingParams) else PoolingParams()
        if params.task not in self.info.tasks:
            raise RequestError(f"this model does not support the {params.task} task "
                               f"(it supports: {', '.join(sorted(map(str, self.info.tasks)))})",
                               "task")
        text = prompt if isinstance(prompt, str) else None
        if text is not None:
            if self.loaded.st.do_lower_case:
                text = text.lower()
            cut = self.max_seq_length is not None
            ids = list(self.tokenizer.hf(text, truncation=cut, max_length=self.max_seq_length)
                       ["input_ids"])
        else:
            ids = list(prompt)
        if not ids:
            raise RequestError("the input is empty", "input")
        keep = params.truncate_prompt_tokens
        if keep is not None:
            if keep < -1 or keep == 0:
                raise RequestError("truncate_prompt_tokens must be -1 or >= 1",
                                   "truncate_prompt_tokens")
            keep = self.limits.max_model_len if keep == -1 else keep
            if keep > self.limits.max_model_len:
                raise RequestError(f"truncate_prompt_tokens {keep} exceeds max_model_len "
                                   f"{self.limits.max_model_len}", "truncate_prompt_tokens")
            ids = ids[-keep:]
        if len(ids) > self.limits.max_model_len:
            raise RequestError(f"this model's maximum context length is "
                               f"{self.limits.max_model_len} tokens, the input has {len(ids)} "
                               "(set truncate_prompt_tokens to cut it)", "input")
        vocab = self.loaded.model.cfg.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise RequestError(f"token ids must be in [0, {vocab})", "input")
        types = params.token_type_ids
        if getattr(self.loaded.model.cfg, "type_vocab_size", 1) < 2:
            types = None  # one segment type (XLM-R, causal LMs): the pair's ids say it all
        elif types is not None and len(types) != len(ids):
            types = types[-len(ids):]
        if params.dimensions is not None:
            dims = self.info.matryoshka_dimensions
            if dims is None:
                raise RequestError("dimensions is not supported: this model is not a "
                                   "Matryoshka model", "dimensions")
            if params.dimensions < 1 or params.dimensions > self.info.hidden_size or (
                    dims and params.dimensions not in dims):
                raise RequestError(f"dimensions {params.dimensions} is not supported (this "
                                   f"model: {list(dims) or f'1 to {self.info.hidden_size}'})",
                                   "dimensions")
        params = PoolingParams(params.task, params.dimensions, params.normalize,
                               params.truncate_prompt_tokens, types, params.activation)
        return PoolingRequest(request_id, prompt if isinstance(prompt, str) else None, ids,
                              params, arrival_time or time.monotonic(), client)

    def pair_tokens(self, text_1: str, text_2: str) -> tuple[list[int], tuple[int, ...] | None]:
        """A (query, document) pair as a cross-encoder reads it: one input with the
        tokenizer's separators, cut to the context, and its segment ids (BERT). An LLM
        reranker reads the two texts as one prompt, never cut here: one too long for the
        context is refused when the request is prepared (unless truncate_prompt_tokens)."""
        if self.info.pairs_as_text:  # a prompt cut at its end would ask something else
            enc = self.tokenizer.hf(text_1 + text_2)
        else:
            enc = self.tokenizer.hf(text_1, text_2, truncation=True,
                                    max_length=self.limits.max_model_len)
        types = enc.get("token_type_ids")
        return list(enc["input_ids"]), tuple(types) if types is not None else None

    def add_request(self, request_id: str, prompt: str | list[int],
                    params: PoolingParams | None = None) -> None:
        self.enqueue(self.prepare(request_id, prompt, params))

    def enqueue(self, request: PoolingRequest) -> None:
        if request.request_id in self.scheduler.waiting:
            raise RequestError(f"request id {request.request_id!r} is already in use",
                               "request_id")
        self.scheduler.add(request)

    def abort_request(self, request_id: str) -> PoolingRequestOutput | None:
        request = self.scheduler.abort(request_id)
        if request is None:
            return None
        return PoolingRequestOutput(request_id, request.prompt, request.token_ids, [], True,
                                    error="aborted before it ran")

    def step(self) -> list[PoolingRequestOutput]:
        batch = self.scheduler.schedule()
        if not batch:
            return []
        started = time.monotonic()
        try:
            rows = self.runner.execute(
                [EncoderRow(r.token_ids, r.params.token_type_ids) for r in batch])
        except Exception as exc:  # noqa: BLE001 - retried one by one below
            return self._isolate_failure(batch, exc)
        self.failed_steps.reset()
        return [self._output(r, row, started) for r, row in zip(batch, rows)]

    def _output(self, request: PoolingRequest, row: torch.Tensor,
                started: float) -> PoolingRequestOutput:
        now = time.monotonic()
        metrics = RequestMetrics(request.arrival_time, started, now, now, now)
        return PoolingRequestOutput(
            request.request_id, request.prompt, request.token_ids, [], True, metrics,
            data=finish(row, request.params, self.loaded.normalize))

    def _isolate_failure(self, batch: list[PoolingRequest],
                         exc: Exception) -> list[PoolingRequestOutput]:
        """A batch raised: each request runs alone, so a fault tied to one ends only it."""
        outputs = []
        succeeded = False
        for request in batch:
            started = time.monotonic()
            try:
                row = self.runner.execute([EncoderRow(request.token_ids,
                                                      request.params.token_type_ids)])[0]
            except Exception as sub_exc:  # noqa: BLE001 - this request's own fault
                logger.exception("pooling request %s failed", request.request_id)
                outputs.append(PoolingRequestOutput(
                    request.request_id, request.prompt, request.token_ids, [], True,
                    error=f"{type(sub_exc).__name__}: {sub_exc}"))
                continue
            succeeded = True
            outputs.append(self._output(request, row, started))
        self.failed_steps.observe(succeeded, exc)
        return outputs

    def request_ids(self) -> list[str]:
        return list(self.scheduler.waiting)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> EngineStats:
        return EngineStats(0, len(self.scheduler.waiting), 0, 0, 0.0, 0)

    def shutdown(self, graceful: bool = True) -> None:
        del graceful

    def reset_prefix_cache(self) -> int:
        return 0  # no KV cache, no prefixes

    def sleep(self, level: SleepLevel) -> list[Any]:
        del level
        raise RequestError("sleep mode is not supported with --runner pooling")

    def wake_up(self, tags: frozenset[WakeTag] = ALL_TAGS) -> None:
        del tags
        raise RequestError("sleep mode is not supported with --runner pooling")

    def reload_weights(self, path: str) -> None:
        del path
        raise RequestError("weight reload is not supported with --runner pooling")


def _token_id(hf: Any) -> Callable[[str], int | None]:
    """The tokenizer's id of one token (None: not in its vocabulary, where it would map to
    the unknown token)."""
    def find(token: str) -> int | None:
        found = hf.convert_tokens_to_ids(token)
        unknown = getattr(hf, "unk_token_id", None)
        if found is None or (found == unknown and token != getattr(hf, "unk_token", None)):
            return None
        return int(found)
    return find


def _id2label(folder: str) -> dict[int, str]:
    try:
        cfg = json.loads(Path(folder, "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return {int(k): str(v) for k, v in (cfg.get("id2label") or {}).items()}
