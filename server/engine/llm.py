"""Offline batch API: ``LLM().generate(prompts, params)`` and ``LLM().chat(messages)``; for
pooling models ``embed``, ``classify`` and ``score``."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence as Seq
from typing import Any, Union

from server.config import make_engine_config
from server.config.compat import ignored_flags
from server.engine.beam_search import BeamSearch, BeamSearchParams
from server.engine.executor.mp import refuse_engine_in_worker
from server.engine.llm_engine import LLMEngine
from server.engine.lora.request import LoRARequest
from server.engine.outputs import RequestOutput
from server.engine.pooling import offline
from server.engine.pooling.engine import PoolingEngine
from server.engine.pooling.params import PoolingParams
from server.engine.pooling.select import build_engine
from server.engine.sampling_params import SamplingParams
from server.log import init_logging

logger = logging.getLogger(__name__)

Prompt = Union[str, list[int]]
# vLLM's prompt dict: {"prompt": text} or {"prompt_token_ids": ids}, with
# "multi_modal_data": {"image": an image or a list of them} (PIL images)
PromptDict = dict[str, Any]
Messages = list[dict[str, Any]]


class LLM:
    """Loads a model once and runs batches of prompts through continuous batching.

    ``LLM()`` serves the embedded SmolLM2-135M-Instruct; keyword options use ``vllm serve``'s
    names (``max_num_seqs=32``, ``dtype="float32"``, ``block_size=16``...).
    """

    def __init__(self, model: str | None = None, **options: Any) -> None:
        refuse_engine_in_worker()  # before any loading: the worker is only importing a script
        init_logging()
        config = make_engine_config(model=model, **options)
        for line in ignored_flags(config.vllm_no_op):  # LLM(trust_remote_code=True)...
            logger.warning("%s", line)
        self.engine: LLMEngine | PoolingEngine = build_engine(config)
        self.engine.warmup()
        self._ids = itertools.count()

    @property
    def tokenizer(self):  # noqa: ANN201 - server.engine.tokenizer.Tokenizer
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` and ``chat`` use when given no params (vLLM's method): the
        model's generation config (``generation_config``, default auto), else the defaults
        of SamplingParams."""
        defaults = self.engine.sampling_defaults.as_dict()
        return SamplingParams(**defaults) if defaults else SamplingParams()

    def shutdown(self) -> None:
        """Stops the other ranks of ``tensor_parallel_size > 1`` (else nothing to do; they
        are killed at interpreter exit otherwise)."""
        self.engine.shutdown()

    def generate(
        self,
        prompts: Prompt | PromptDict | Seq[Prompt | PromptDict],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """One finished RequestOutput per prompt, in the order given: each step's deltas
        accumulated into whole completions. ``lora_request``: the adapter of every prompt,
        or one per prompt (None: the base model), as vLLM's (``enable_lora=True``). A
        prompt may be vLLM's dict, ``{"prompt": text, "multi_modal_data": {"image":
        image_or_list}}``: each image placeholder of the text (``<image>`` for LLaVA) takes
        the next image."""
        if isinstance(self.engine, PoolingEngine):
            raise ValueError("this model is served by the pooling runner (runner='pooling'): "
                             "use embed, classify or score")
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = _as_params_list(sampling_params, len(prompt_list))
        loras = (list(lora_request) if isinstance(lora_request, (list, tuple))
                 else [lora_request] * len(prompt_list))
        if len(loras) != len(prompt_list):
            raise ValueError(f"{len(loras)} lora_request for {len(prompt_list)} prompts")
        request_ids = []
        for prompt, p, lora in zip(prompt_list, params, loras):
            request_id = f"offline-{next(self._ids)}"
            text, images = _prompt_and_images(prompt)
            self.engine.add_request(request_id, text, p, lora_request=lora,
                                    **({"images": images} if images else {}))
            request_ids.append(request_id)
        results: dict[str, RequestOutput] = {}
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.request_id in results:
                        results[out.request_id].add(out)
                    else:
                        results[out.request_id] = out
        finally:
            for request_id in request_ids:
                if request_id not in results or not results[request_id].finished:
                    self.engine.abort_request(request_id)
        return [results[r] for r in request_ids]

    def beam_search(
        self,
        prompts: Prompt | dict[str, Any] | Seq[Prompt | dict[str, Any]],
        params: BeamSearchParams,
        lora_request: LoRARequest | None = None,
    ) -> list[RequestOutput]:
        """vLLM's ``LLM.beam_search``: per prompt (text, token ids, or ``{"prompt": ...}`` /
        ``{"prompt_token_ids": [...]}``) its ``beam_width`` best sequences, best first, as the
        completions of one finished RequestOutput (server/engine/beam_search.py). Each step
        runs every live beam of every prompt in one batch; beams share their prefix's KV
        blocks through the prefix cache."""
        if isinstance(self.engine, PoolingEngine):
            raise ValueError("beam search needs a generating model, not a pooling one")
        items = [prompts] if isinstance(prompts, (str, dict)) else _as_prompt_list(prompts)
        eos = self.tokenizer.hf.eos_token_id
        limit = self.engine.limits.max_model_len
        searches = [BeamSearch(self._token_ids(p), params, eos, limit) for p in items]
        while live := [s for s in searches if not s.done]:
            batch = [(s, beam) for s in live for beam in s.pending()]
            outs = self.generate([beam for _, beam in batch], live[0].expansion_params(),
                                 lora_request)
            for search in live:
                mine = [o for (s, _), o in zip(batch, outs) if s is search]
                search.advance([o.outputs[0].logprobs[0] for o in mine])
        return [s.output(f"beam-{next(self._ids)}", self.tokenizer.decode) for s in searches]

    def _token_ids(self, prompt: Prompt | dict[str, Any]) -> list[int]:
        if isinstance(prompt, dict):
            prompt = prompt["prompt_token_ids"] if "prompt_token_ids" in prompt \
                else prompt["prompt"]
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)

    def chat(
        self,
        messages: Messages | Seq[Messages],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Applies the model's chat template to each conversation, then generates."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts: list[Prompt] = [
            self.tokenizer.encode_chat(list(conv), add_generation_prompt=add_generation_prompt)
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params)

    def _pooling(self) -> PoolingEngine:
        if not isinstance(self.engine, PoolingEngine):
            raise ValueError("this model generates text: embed, classify and score need a "
                             "pooling model (runner='pooling')")
        return self.engine

    def embed(self, prompts: Prompt | Seq[Prompt],
              pooling_params: PoolingParams | None = None
              ) -> list[offline.PoolingOutputs[offline.EmbeddingOutput]]:
        """One embedding per prompt (``out.outputs.embedding``), in the order given."""
        return offline.embed(self._pooling(), prompts, pooling_params)

    def classify(self, prompts: Prompt | Seq[Prompt]
                 ) -> list[offline.PoolingOutputs[offline.ClassificationOutput]]:
        """Class probabilities per prompt (``out.outputs.probs``)."""
        return offline.classify(self._pooling(), prompts)

    def score(self, data_1: str | Seq[str], data_2: str | Seq[str]
              ) -> list[offline.PoolingOutputs[offline.ScoringOutput]]:
        """A score per (data_1, data_2) pair (``out.outputs.score``): 1:1, 1:N or N:N."""
        return offline.score(self._pooling(), data_1, data_2)


def _prompt_and_images(prompt: Prompt | PromptDict) -> tuple[Prompt, tuple[Any, ...]]:
    """A prompt as text or ids, and its images (vLLM's ``multi_modal_data``)."""
    if not isinstance(prompt, dict):
        return prompt, ()
    unknown = set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data"}
    if unknown:
        raise ValueError(f"prompt dict: unsupported keys {sorted(unknown)}")
    text = prompt.get("prompt", prompt.get("prompt_token_ids"))
    if text is None:
        raise ValueError("prompt dict needs \"prompt\" or \"prompt_token_ids\"")
    data = prompt.get("multi_modal_data") or {}
    if set(data) - {"image"}:
        raise ValueError(f"multi_modal_data: only \"image\" is supported, got {sorted(data)}")
    images = data.get("image", ())
    return text, tuple(images) if isinstance(images, (list, tuple)) else (images,)


def _as_prompt_list(prompts: Prompt | PromptDict | Seq[Prompt | PromptDict]
                    ) -> list[Prompt | PromptDict]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [items]  # a single prompt given as token ids
    return items


def _as_params_list(
    params: SamplingParams | Seq[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    items = list(params)
    if len(items) != count:
        raise ValueError(f"{len(items)} sampling params for {count} prompts")
    return items
