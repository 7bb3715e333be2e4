"""Requests in: tokenize the prompt, check it against the model and the cache, and build
the sequences and per-completion state that the engine will queue."""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from concurrent.futures import Future
from typing import Any

from server.config import SchedulerLimits
from server.engine.core.block_manager import blocks_for
from server.engine.core.sequence import Sequence
from server.engine.detokenizer import IncrementalDetokenizer
from server.engine.errors import RequestError
from server.engine.lora.request import LoRARequest
from server.engine.multimodal.inputs import ImageSpan
from server.engine.multimodal.prompts import ImagePrompts
from server.engine.outputs import CompletionOutput, RequestMetrics
from server.engine.request_state import RequestState
from server.engine.sampling_params import SamplingParams
from server.engine.structured_outputs.backend import StructuredOutputs
from server.engine.tokenizer import Tokenizer

# The structured-outputs backend, built on first use (reading a vocabulary takes a moment).
StructuredOutputsSource = Callable[[], StructuredOutputs]


class InputProcessor:
    """Turns a prompt (text or token ids) and its params into a :class:`RequestState`.

    Touches no engine state, so the async engine runs it off the engine thread: a long
    prompt's tokenization never delays a step. Requests that can never be served (empty,
    beyond ``max_model_len``, bigger than the whole KV cache, unknown token ids) raise
    :class:`RequestError` with the numbers.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, limits: SchedulerLimits,
                 block_size: int, num_blocks: int, structured: StructuredOutputsSource,
                 images: ImagePrompts | None = None) -> None:
        self.tokenizer = tokenizer
        self.images = images  # a vision-language model's processor (None: text only)
        self.structured = structured
        self.vocab_size = vocab_size
        self.limits = limits
        self.block_size = block_size
        self.num_blocks = num_blocks
        self._seq_ids = itertools.count()

    def process(self, request_id: str, prompt: str | list[int],
                params: SamplingParams | None = None,
                arrival_time: float | None = None, client: str = "",
                grammar: bool = True, lora: LoRARequest | None = None,
                images: Seq[Any] = ()) -> RequestState:
        """``grammar``: compile the request's constraint here (blocking, within the
        bounds of ``--grammar-compile-timeout``); False: only check it against the caps,
        and leave :meth:`start_grammar` / :meth:`attach_grammar` to the caller.
        ``images``: the prompt's images (PIL), one per placeholder token, in order."""
        params = params or SamplingParams()
        if params.structured_outputs is not None:
            # before tokenizing: a constraint beyond the caps costs nothing more
            self.structured().check(params.structured_outputs)
        prompt_text = prompt if isinstance(prompt, str) else None
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        keep = params.truncate_prompt_tokens
        if keep is not None:  # by default the prompt's end matters: its last tokens are kept
            if keep == -1:  # as much as the context holds beside what is to be generated
                keep = max(1, self.limits.max_model_len - (params.max_tokens or 1))
            if keep == 0:
                raise RequestError("truncate_prompt_tokens 0 leaves no prompt",
                                   "truncate_prompt_tokens")
            prompt_ids = prompt_ids[:keep] if params.truncation_side == "right" \
                else prompt_ids[-keep:]
            prompt_text = None  # the text sent is no longer the prompt's
        spans: tuple[ImageSpan, ...] = ()
        if images:
            prompt_ids, spans = self._images(prompt_ids, images, params)
        params = self._check(prompt_ids, params)
        if params.bad_words:
            params = params.model_copy(update={
                "bad_words_token_ids": self._bad_words_ids(params.bad_words)})
        now = arrival_time if arrival_time is not None else time.monotonic()
        seqs = [Sequence(next(self._seq_ids), request_id, i, prompt_ids, params, now,
                         client=client, lora=lora, images=spans)
                for i in range(params.n)]
        state = RequestState(
            request_id, prompt_text, prompt_ids, params, seqs,
            [self._detokenizer(prompt_ids, params) for _ in seqs],
            [CompletionOutput(i, logprobs=None if params.logprobs is None else [])
             for i in range(params.n)],
            RequestMetrics(arrival_time=now),
            prompt_logprobs=None if params.prompt_logprobs is None else [None],
        )
        if grammar and params.structured_outputs is not None:
            self.attach_grammar(state, self.structured().compile(params.structured_outputs,
                                                                  client))
        return state

    def start_grammar(self, state: RequestState, client: str = "") -> Future[Any] | None:
        """Starts compiling the request's constraint (checked by :meth:`process`): a
        future of the compiled grammar (a RequestError naming the field when it fails;
        cancel it to free the worker), or None without a constraint. Never blocks."""
        spec = state.params.structured_outputs
        return None if spec is None else self.structured().compile_async(spec, client)

    def attach_grammar(self, state: RequestState, compiled: Any) -> None:
        """Gives each completion its own matcher of the compiled grammar (cheap: ~50 us)."""
        spec = state.params.structured_outputs
        assert spec is not None
        backend = self.structured()
        decode = functools.partial(self.tokenizer.decode, skip_special_tokens=False)
        for seq in state.seqs:
            seq.grammar = backend.state(compiled, spec.start_after or None, decode)

    def _images(self, prompt_ids: list[int], images: Seq[Any], params: SamplingParams
                ) -> tuple[list[int], tuple[ImageSpan, ...]]:
        """The prompt with its image placeholders expanded, and each image's span."""
        if self.images is None:
            raise RequestError("images are not supported by this text-only model", "messages")
        if params.truncate_prompt_tokens is not None:
            raise RequestError("truncate_prompt_tokens cannot be combined with images (it "
                               "would cut through an image's tokens)", "truncate_prompt_tokens")
        ids, spans = self.images.process(prompt_ids, images, "messages")
        budget = self.limits.max_num_batched_tokens
        longest = max((s.length for s in spans), default=0)
        if longest > budget:
            raise RequestError(f"an image takes {longest} tokens, more than a step "
                               f"computes (--max-num-batched-tokens {budget})", "messages")
        return ids, spans

    def _check(self, prompt_ids: list[int], params: SamplingParams) -> SamplingParams:
        """Raises for what can never be served; fills in ``max_tokens`` when unset."""
        max_len = self.limits.max_model_len
        vocab = self.vocab_size
        if not prompt_ids:
            raise RequestError("the prompt is empty", "prompt")
        if params.priority and self.limits.policy != "priority":
            raise RequestError("priority needs the server started with --scheduling-policy "
                               "priority", "priority")
        bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:  # vLLM's words, which its clients match
            raise RequestError(f"Token id {bad} is out of vocabulary (ids are in "
                               f"[0, {vocab}))", "prompt")
        if params.logit_bias and any(not 0 <= t < vocab for t in params.logit_bias):
            raise RequestError(f"logit_bias token ids must be in [0, {vocab})", "logit_bias")
        if params.allowed_token_ids and params.structured_outputs is not None:
            # two masks that may leave nothing to sample: a constraint already says what may
            raise RequestError("allowed_token_ids cannot be combined with a structured output "
                               "constraint (response_format, structured_outputs, guided_*, "
                               "forced tool calls)", "allowed_token_ids")
        if params.allowed_token_ids and any(not 0 <= t < vocab
                                            for t in params.allowed_token_ids):
            raise RequestError(f"allowed_token_ids must be in [0, {vocab})", "allowed_token_ids")
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
        if needed > self.num_blocks:
            raise RequestError(
                f"the request needs {needed} KV blocks but the cache has only "
                f"{self.num_blocks}", "max_tokens",
            )
        return params

    def _bad_words_ids(self, words: list[str]) -> list[list[int]]:
        """vLLM's reading of ``bad_words``: each word as it starts a text and, where that
        tokenizes differently (another first token, as many tokens), after a space, so it is
        banned at the start and in the middle of the text alike."""
        ids: list[list[int]] = []
        for word in words:
            bare = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            if not bare:
                raise RequestError(f"bad_words: {word!r} has no tokens", "bad_words")
            ids.append(bare)
            if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
                ids.append(spaced)
        bad = sorted({t for word in ids for t in word if not 0 <= t < self.vocab_size})
        if bad:
            raise RequestError(f"bad_words: token ids {bad} are outside the model's "
                               f"vocabulary of {self.vocab_size}", "bad_words")
        return ids

    def _detokenizer(self, prompt_ids: list[int], params: SamplingParams) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(
            self.tokenizer, prompt_ids, skip_special_tokens=params.skip_special_tokens,
            stop=params.stop, include_stop_str_in_output=params.include_stop_str_in_output,
            min_tokens=params.min_tokens,
        )
