"""Checks on a parsed request that its schema cannot express: deployment limits (the
``--max-*`` flags) and fields that would change the answer but are not implemented.

Unknown fields that do not change the answer (``user``, ``store``, ``metadata``...) stay
ignored, as OpenAI ignores what it does not know; the ones below are refused with 400
naming the field, because ignoring them would hand back a different answer than the client
asked for (free text instead of JSON, no tool call...).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from server.api.errors import APIError
from server.api.protocol import SamplingFields
from server.config import RequestLimits


def _unset(value: Any, _: SamplingFields) -> bool:
    return value is None or value is False or value == [] or value == {}


def _only(*harmless: Any) -> Callable[[Any, SamplingFields], bool]:
    return lambda value, req: _unset(value, req) or value in harmless


# field -> whether the value changes nothing (then it is accepted and ignored)
_UNSUPPORTED_ANY: Mapping[str, Callable[[Any, SamplingFields], bool]] = {
    "guided_whitespace_pattern": _unset,
    "logits_processors": _unset,
    "prompt_embeds": _unset,
    # forcing the end of thinking needs the parser's end-of-thinking token; the reasoning
    # parsers here match text markers. -1 is vLLM's "unlimited" (unset).
    "thinking_token_budget": lambda value, _: value is None or value == -1,
}
_UNSUPPORTED_CHAT: Mapping[str, Callable[[Any, SamplingFields], bool]] = {
    **_UNSUPPORTED_ANY,
    "functions": _unset,
    "function_call": _only("none"),
    "modalities": _only(["text"]),
    "audio": _unset,
    # predicted outputs: a latency feature this server does not implement
    "prediction": _unset,
    "web_search_options": _unset,
    "verbosity": _unset,
    # a template from the request runs on the server: refused, as vLLM does unless
    # --trust-request-chat-template
    "chat_template": _unset,
    "add_special_tokens": _unset,
}
_UNSUPPORTED_COMPLETION: Mapping[str, Callable[[Any, SamplingFields], bool]] = {
    **_UNSUPPORTED_ANY,
    # best_of candidates ranked by likelihood; best_of == n is plain sampling
    "best_of": lambda value, req: value is None or value in (1, req.n),
    "add_special_tokens": lambda value, _: value is None or value is True,
}


def reject_unsupported(req: SamplingFields, chat: bool) -> None:
    """400 naming the first field that asks for something this server does not do."""
    table = _UNSUPPORTED_CHAT if chat else _UNSUPPORTED_COMPLETION
    for name, value in (req.model_extra or {}).items():
        harmless = table.get(name)
        if harmless is not None and not harmless(value, req):
            raise APIError(400, f"{name} is not supported by this server (refused rather than "
                                "ignored: it would change the answer)", name,
                           "unsupported_parameter")


def check_limits(limits: RequestLimits, req: SamplingFields, *, max_model_len: int,
                 prompts: int, max_tokens: int | None, max_tokens_field: str,
                 logprobs: int | None, logprobs_field: str) -> None:
    """400 naming the field for a request beyond the deployment's ``--max-*`` limits."""
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    _at_most(len(stops), limits.max_stop_strings, "stop", "stop strings", flag="max-stop-strings")
    _at_most(len(req.stop_token_ids or ()), limits.max_stop_token_ids, "stop_token_ids",
             "stop token ids")
    _at_most(len(req.logit_bias or {}), limits.max_logit_bias, "logit_bias", "entries",
             flag="max-logit-bias")
    _at_most(prompts, limits.max_prompts, "prompt", "prompts", flag="max-prompts")
    if logprobs is not None and logprobs > limits.max_logprobs:
        raise APIError(400, f"{logprobs_field}: at most {limits.max_logprobs} logprobs per token "
                            f"(--max-logprobs), got {logprobs}", logprobs_field)
    if req.min_tokens > max_model_len:
        raise APIError(400, f"min_tokens ({req.min_tokens}) exceeds the context length "
                            f"({max_model_len})", "min_tokens")
    seqs = prompts * req.n
    if seqs > limits.max_seqs_per_request:
        # each sequence takes a batch slot and KV blocks until it ends: bounded apart from
        # the tokens, which a short max_tokens keeps small however many sequences there are
        field = "n" if req.n > 1 else "prompt"
        raise APIError(400, f"this request asks for {seqs} sequences ({prompts} prompt(s) x "
                            f"n={req.n}), more than --max-seqs-per-request "
                            f"{limits.max_seqs_per_request}; lower {field}", field)
    per_completion = max_tokens if max_tokens is not None else max_model_len
    total = prompts * req.n * per_completion
    if total > limits.max_tokens_per_request:
        unset = "" if max_tokens is not None else " (unset: the context length)"
        raise APIError(
            400, f"this request may generate {total} tokens ({prompts} prompt(s) x n={req.n} x "
                 f"{max_tokens_field}={per_completion}{unset}), more than "
                 f"--max-tokens-per-request {limits.max_tokens_per_request}; lower n or "
                 f"{max_tokens_field}", max_tokens_field if max_tokens is not None else "n")


def prompt_logprobs_of(limits: RequestLimits, req: SamplingFields, vocab_size: int,
                       implied: int | None = None) -> int | None:
    """The engine's ``prompt_logprobs`` for the request (``implied``: what echo with
    logprobs asks for when the field is unset), with vLLM's checks and words; -1 means the
    whole vocabulary, which --max-logprobs must then allow."""
    value = req.prompt_logprobs
    if value is not None:
        if req.stream and (value > 0 or value == -1):
            raise APIError(400, "`prompt_logprobs` are not available when `stream=True`.",
                           "prompt_logprobs")
        if value < -1:
            raise APIError(400, "`prompt_logprobs` must be a positive value or -1.",
                           "prompt_logprobs")
    else:
        value = implied
    if value is None:
        return None
    k = vocab_size if value == -1 else value
    if k > limits.max_logprobs:
        raise APIError(400, f"prompt_logprobs: at most {limits.max_logprobs} logprobs per "
                            f"token (--max-logprobs), got {value}", "prompt_logprobs")
    return k


def check_messages(limits: RequestLimits, count: int) -> None:
    _at_most(count, limits.max_messages, "messages", "messages")


def _at_most(count: int, limit: int, field: str, what: str, flag: str | None = None) -> None:
    if count > limit:
        flag = flag or f"max-{field.replace('_', '-')}"
        raise APIError(400, f"{field}: at most {limit} {what} per request (--{flag}), "
                            f"got {count}", field)
