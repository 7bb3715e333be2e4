"""Structured outputs: a grammar per request, a token mask per step (xgrammar).

A request's constraint (JSON schema, any JSON object, regex, choice, EBNF grammar) is compiled
once, off the engine thread (the input processor runs in a worker thread) and cached by the
compiler by its text; each sequence gets its own matcher. Every step the batch's matchers
fill a ``[rows, ceil(vocab / 32)]`` bitmask (rows without a grammar: all ones), which the
sampler applies as plain tensor ops before anything else, so guided and unguided requests
share steps and the masked logprobs are what the client sees. Accepting each sampled token
advances the matcher; preemption keeps the tokens (recomputed, never discarded), so a
matcher never needs rolling back here.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from server.engine.errors import RequestError
from server.engine.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# The backends ``--structured-outputs-backend`` accepts ("auto" is xgrammar).
BACKENDS = ("auto", "xgrammar")


class GrammarState:
    """One sequence's matcher, plus what the engine needs to know about it."""

    def __init__(self, matcher: Any, start_after: str | None = None,
                 decode: Callable[[list[int]], str] | None = None) -> None:
        self.matcher = matcher
        # the text after which the constraint starts (the end of a reasoning section, such
        # as "</think>"); None: from the first generated token
        self.start_after = start_after
        self._decode = decode
        self.active = start_after is None

    def observe(self, output_token_ids: list[int]) -> None:
        """Activates the constraint once the generated text reaches ``start_after``.

        Compared as text, not as token ids: a marker that is plain text for the tokenizer
        merges with its neighbours differently in context. Every token holds at least one
        character, so the last ``len(marker)`` tokens are enough to find it."""
        if self.active or self.start_after is None or self._decode is None:
            return
        tail = self._decode(output_token_ids[-len(self.start_after):])
        self.active = self.start_after in tail

    @property
    def terminated(self) -> bool:
        return bool(self.matcher.is_terminated())


class StructuredOutputs:
    """The xgrammar backend of one model: its vocabulary, a compile cache, masks."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int,
                 stop_token_ids: list[int] | None = None) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        self._info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size,
                                                        stop_token_ids=stop_token_ids)
        # One thread: compilation runs in the request's worker thread already.
        self._compiler = xgr.GrammarCompiler(self._info, max_threads=1, cache_enabled=True)
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The compiled grammar of ``spec`` (cached by its text); an invalid schema, regex or
        grammar raises :class:`RequestError` naming the request field it came from."""
        start = time.perf_counter()
        try:
            with self._lock:  # the compiler's cache is shared by the worker threads
                compiled = self._compile(spec)
        except RequestError:
            raise
        except Exception as exc:  # xgrammar reports bad input as various exceptions
            raise RequestError(f"{spec.field}: invalid {spec.kind}: {exc}", spec.field) from None
        logger.debug("compiled a %s grammar in %.1f ms", spec.kind,
                     (time.perf_counter() - start) * 1e3)
        return compiled

    def _compile(self, spec: StructuredOutputsParams) -> Any:
        compiler = self._compiler
        if spec.json_schema is not None:
            schema = (spec.json_schema if isinstance(spec.json_schema, str)
                      else json.dumps(spec.json_schema))
            json.loads(schema)  # a clear error for text that is not JSON at all
            # Compact JSON: with free whitespace a small model at temperature 1 can pad
            # forever and hit max_tokens mid-object.
            return compiler.compile_json_schema(schema, any_whitespace=False)
        if spec.json_object:
            # OpenAI's json_object mode: an object (a bare JSON value would do for xgrammar's
            # builtin grammar), compact like the schemas.
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if spec.regex is not None:
            re.compile(spec.regex)
            return compiler.compile_regex(spec.regex)
        if spec.choice is not None:
            return compiler.compile_regex("|".join(re.escape(c) for c in spec.choice))
        assert spec.grammar is not None
        return compiler.compile_grammar(spec.grammar)

    def state(self, compiled: Any, start_after: str | None = None,
              decode: Callable[[list[int]], str] | None = None) -> GrammarState:
        return GrammarState(self._xgr.GrammarMatcher(compiled), start_after, decode)

    def bitmask(self, states: list[GrammarState | None]) -> torch.Tensor | None:
        """``[rows, words]`` int32 of allowed tokens, or None when no row is constrained
        (all ones where a row has no active grammar)."""
        if not any(s is not None and s.active and not s.terminated for s in states):
            return None
        mask = self._xgr.allocate_token_bitmask(len(states), self.vocab_size)
        for row, state in enumerate(states):
            if state is not None and state.active and not state.terminated:
                state.matcher.fill_next_token_bitmask(mask, row)
        return mask


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Disallowed tokens to -inf: bit ``t % 32`` of word ``t // 32`` allows token ``t``.
    Plain tensor ops, so it runs on whatever device the logits are on."""
    rows, vocab = logits.shape
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    words = bitmask.to(logits.device)[:rows]
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().reshape(rows, -1)[:, :vocab]
    return logits.masked_fill(~allowed, float("-inf"))
