"""A scripted engine for fast tests of the serving layer (no model, no threads).

Tokens are characters (token id = code point). Completion ``i`` of a request generates the
letters ``a``, ``b``, ``c``... shifted by ``i``, one token per step, each with logprob
-0.5 and, when asked, top alternatives (the token itself, then ``z`` at -1.5).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

from prometheus_client import CollectorRegistry

from server.engine.inputs import Offload, PromptBuilder
from server.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob
from server.engine.sampling_defaults import NO_DEFAULTS
from server.engine.sampling_params import SamplingParams


class CharTokenizer:
    vocab_size = 0x110000
    eos_token_ids = frozenset()
    max_token_bytes = 4  # one character

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)

    def token_str(self, token_id: int) -> str:
        return chr(token_id)

    def __init__(self) -> None:
        self.template_calls: list[dict[str, Any]] = []  # what the chat template was given

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None,
                            template_kwargs: dict[str, Any] | None = None,
                            continue_final_message: bool = False,
                            documents: list[dict[str, str]] | None = None) -> str:
        self.template_calls.append(dict(messages=messages, tools=tools,
                                        template_kwargs=template_kwargs, documents=documents))
        return "|".join(str(m.get("content") or "") for m in messages)

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
                    ) -> list[int]:
        return self.encode(self.apply_chat_template(messages, add_generation_prompt))


def letter(step: int, index: int) -> int:
    return ord("a") + (step + index) % 25  # never "z": that is the alternative


class FakeEngine:
    model_name = "fake-model"
    max_model_len = 1024
    pooling = None  # a generative model
    vision = None  # a text-only model
    sampling_defaults = NO_DEFAULTS

    def __init__(self, script: list[str] | None = None) -> None:
        """``script``: the model's answer, piece by piece (one piece per step and token,
        finishing with "stop"), instead of the letters."""
        self.script = script
        self.tokenizer = CharTokenizer()
        self.metrics_registry = CollectorRegistry()
        self.is_alive = True
        self.submitted: list[tuple[str, str | list[int], SamplingParams]] = []
        self.aborted: list[str] = []

    def start(self) -> None:
        pass

    async def shutdown(self) -> None:
        pass

    def stats(self) -> SimpleNamespace:
        return SimpleNamespace(num_running=0, num_waiting=0, kv_cache_usage=0.0,
                               num_preemptions=0)

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def stalled_for(self) -> float:
        return 0.0

    def lora_adapter(self, name: str) -> None:
        return None

    def lora_adapters(self) -> list[Any]:
        return []

    def observed_shapes(self) -> dict[str, Any]:
        return {"format": "hpu-serve/observed-shapes/v1", "phases": {}, "warmup_seconds": {}}

    async def submit(self, request_id: str, prompt: str | list[int] | PromptBuilder,
                     params: SamplingParams | None = None, client: str = "",
                     offload: Offload | None = None,
                     lora_request: Any = None) -> AsyncIterator[RequestOutput]:
        if callable(prompt):  # built as the real engine does: one job on the offload
            given = await (offload or asyncio.to_thread)(prompt)
            prompt, params = given.prompt, given.params
        params = params or SamplingParams()
        self.submitted.append((request_id, prompt, params))
        return self._outputs(request_id, prompt, params)

    async def _outputs(self, request_id: str, prompt: str | list[int], params: SamplingParams
                       ) -> AsyncIterator[RequestOutput]:
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if self.script is not None:
            for step, piece in enumerate(self.script):
                last = step == len(self.script) - 1
                deltas = [CompletionOutput(i, piece, [ord(piece[0])], None,
                                           "stop" if last else None) for i in range(params.n)]
                yield RequestOutput(request_id, None, prompt_ids, deltas, last,
                                    RequestMetrics(arrival_time=0.0),
                                    num_generated_tokens=(step + 1) * params.n)
            return
        steps = params.max_tokens or 4
        for step in range(steps):
            last = step == steps - 1
            deltas = []
            for i in range(params.n):
                token = letter(step, i)
                logprobs = None
                if params.logprobs is not None:
                    top = [(token, -0.5), (ord("z"), -1.5)][: params.logprobs]
                    logprobs = [TokenLogprob(token, -0.5, top)]
                deltas.append(CompletionOutput(i, chr(token), [token], logprobs,
                                               "length" if last else None))
            yield RequestOutput(request_id, prompt if isinstance(prompt, str) else None,
                                prompt_ids, deltas, last, RequestMetrics(arrival_time=0.0),
                                num_generated_tokens=(step + 1) * params.n)


def expected_text(steps: int, index: int) -> str:
    return "".join(chr(letter(s, index)) for s in range(steps))
