"""Answers as JSON without a pydantic object per token: logprobs as plain dicts or JSON
text, and whole non-streamed answers serialized choice by choice (run on a worker).

A chat answer with n=128, 512 tokens and 20 top logprobs holds 1.3M logprob entries: as
pydantic objects they took seconds and hundreds of MB on the event loop. Here each token's
JSON text (its string and bytes never change) is made once and cached per token id, and an
entry is a few string joins. Serializing one choice at a time keeps each C-level
``json.dumps`` call short, so the worker hands the GIL back to the loop between them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import BaseModel

from server.engine.outputs import TokenLogprob

LOGPROB_FLOOR = -9999.0  # what vLLM reports for -inf (and here for NaN too)


def json_logprob(value: float) -> float:
    """A logprob JSON can carry: -inf and NaN become -9999.0."""
    return value if math.isfinite(value) else LOGPROB_FLOOR


def dumps(value: Any) -> str:
    """JSON as the server writes it: UTF-8 text, no NaN, no spaces."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def _number(value: float) -> str:
    return repr(float(json_logprob(value)))  # repr is JSON's own form of a finite float


class LogprobFormatter:
    """Logprobs of one tokenizer's tokens, in OpenAI's shapes (thread-safe: the caches only
    grow, one dict assignment at a time)."""

    def __init__(self, token_str: Callable[[int], str]) -> None:
        self.token_str = token_str  # a token's text (a tokenizer's, or "token_id:N")
        self._fragments: dict[int, tuple[str, str]] = {}

    def _fragment(self, token_id: int) -> tuple[str, str]:
        """The JSON before and after a logprob value: ``{"token":..,"logprob":`` and
        ``,"bytes":[..]``."""
        parts = self._fragments.get(token_id)
        if parts is None:
            text = self.token_str(token_id)
            parts = ('{"token":' + dumps(text) + ',"logprob":',
                     ',"bytes":' + dumps(list(text.encode("utf-8"))))
            self._fragments[token_id] = parts
        return parts

    def chat_json(self, entries: Sequence[TokenLogprob]) -> str:
        """A chat choice's ``logprobs`` object as JSON text."""
        fragment = self._fragment
        out = []
        for e in entries:
            tops = []
            for token_id, logprob in e.top:
                head, tail = fragment(token_id)
                tops.append(head + _number(logprob) + tail + "}")
            head, tail = fragment(e.token_id)
            out.append(head + _number(e.logprob) + tail + ',"top_logprobs":[' + ",".join(tops)
                       + "]}")
        return '{"content":[' + ",".join(out) + "]}"

    def chat_dict(self, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
        """The same as plain dicts (a stream chunk's few tokens)."""
        token_str = self.token_str

        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            text = token_str(token_id)
            return {"token": text, "logprob": json_logprob(logprob),
                    "bytes": list(text.encode("utf-8"))}

        return {"content": [dict(entry(e.token_id, e.logprob),
                                 top_logprobs=[entry(t, lp) for t, lp in e.top])
                            for e in entries]}

    def completion_dict(self, entries: Sequence[TokenLogprob | None], offset: int,
                        token_ids: Sequence[int] = ()) -> dict[str, Any]:
        """A completion choice's ``logprobs``; ``offset``: characters of text before it.
        An echoed prompt's first token has no logprob (None): ``token_ids`` names it."""
        token_str = self.token_str
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top_logprobs: list[dict[str, float] | None] = []
        text_offset: list[int] = []
        for i, e in enumerate(entries):
            if e is None:
                text = token_str(token_ids[i])
                tokens.append(text)
                token_logprobs.append(None)
                top_logprobs.append(None)
                text_offset.append(offset)
                offset += len(text)
                continue
            text = token_str(e.token_id)
            tokens.append(text)
            token_logprobs.append(json_logprob(e.logprob))
            # OpenAI's rule: the sampled token's logprob is always among them, so there may
            # be logprobs + 1 entries (logprobs 0: the sampled token's alone)
            top = {text: json_logprob(e.logprob)}
            top.update((token_str(t), json_logprob(lp)) for t, lp in e.top)
            top_logprobs.append(top)
            text_offset.append(offset)
            offset += len(text)
        return {"text_offset": text_offset, "token_logprobs": token_logprobs,
                "tokens": tokens, "top_logprobs": top_logprobs}


    def prompt_logprobs(self, entries: Sequence[TokenLogprob | None]
                        ) -> list[dict[str, Any] | None]:
        """vLLM's ``prompt_logprobs``: per prompt token {token id: {logprob, rank,
        decoded_token}}, the prompt's own token first, then the top k (ranks 1..k)."""
        token_str = self.token_str
        out: list[dict[str, Any] | None] = []
        for e in entries:
            if e is None:
                out.append(None)
                continue
            scored = {str(e.token_id): {"logprob": json_logprob(e.logprob), "rank": e.rank,
                                        "decoded_token": token_str(e.token_id)}}
            for rank, (token_id, logprob) in enumerate(e.top, start=1):
                scored.setdefault(str(token_id), {"logprob": json_logprob(logprob),
                                                  "rank": rank,
                                                  "decoded_token": token_str(token_id)})
            out.append(scored)
        return out


def answer_bytes(skeleton: BaseModel, logprobs: Sequence[str | dict[str, Any] | None]) -> bytes:
    """``skeleton`` (an answer whose choices carry no logprobs) with each choice's logprobs
    (JSON text or a dict, aligned with ``skeleton.choices``) put in, as UTF-8 JSON."""
    data = skeleton.model_dump()
    choices = data.pop("choices")
    parts = [dumps(data)[:-1], ',"choices":[']
    for i, (choice, extra) in enumerate(zip(choices, logprobs)):
        choice.pop("logprobs", None)
        text = extra if isinstance(extra, str) else dumps(extra)
        parts.append(("," if i else "") + dumps(choice)[:-1] + ',"logprobs":' + text + "}")
    parts.append("]}")
    return "".join(parts).encode("utf-8")
