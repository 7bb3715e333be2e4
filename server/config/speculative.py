"""Speculative decoding (``--speculative-config``): vLLM's JSON, checked at start-up."""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from server.config.fields import flag

GROUP = "Speculative decoding"


class SpecMethod(str, enum.Enum):
    """Proposers this server has; vLLM's others (medusa, suffix...) are refused at
    start-up with their name."""

    NGRAM = "ngram"
    DRAFT_MODEL = "draft_model"
    EAGLE = "eagle"  # an EAGLE-1 head on the target's last hidden state
    EAGLE3 = "eagle3"  # an EAGLE-3 head on three of the target's layers' hidden states
    MTP = "mtp"  # the target's own multi-token-prediction layer (DeepSeek-V3)

    def __str__(self) -> str:
        return self.value

    @property
    def reads_hidden_states(self) -> bool:
        """Whether the drafter runs on the target's hidden states (a head, not a model)."""
        return self in (SpecMethod.EAGLE, SpecMethod.EAGLE3, SpecMethod.MTP)


# vLLM's methods this server does not have yet: refused at start-up, saying so
_NOT_YET = frozenset({"medusa", "mlp_speculator", "suffix", "qwen3_next_mtp",
                      "ernie_mtp"})
# vLLM's older names of a method
_ALIASES = {"deepseek_mtp": "mtp"}

# vLLM's keys that this server reads; any other key is a start-up error naming it
_KEYS = frozenset({"method", "num_speculative_tokens", "prompt_lookup_min",
                   "prompt_lookup_max", "model", "draft_tensor_parallel_size",
                   "disable_by_batch_size"})


@dataclass(frozen=True, slots=True)
class SpeculativeSettings:
    """The parsed ``--speculative-config``: ``num_speculative_tokens`` drafts per decode step
    (the verify step's query is one more), proposed by prompt lookup of an n-gram of
    ``prompt_lookup_min``..``prompt_lookup_max`` tokens (``ngram``) or by the smaller
    checkpoint at ``model`` (``draft_model``), by the EAGLE head at ``model`` (``eagle``,
    ``eagle3``), by the target's own MTP layer (``mtp``: ``model`` left out or the
    target's); off above
    ``disable_by_batch_size`` running sequences (None: never off)."""

    method: SpecMethod
    num_speculative_tokens: int
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    disable_by_batch_size: int | None = None
    # draft_model: the draft checkpoint; eagle / eagle3: the head's (a path or a Hub id);
    # mtp: None or the target's (checked against it when the model loads)
    model: str | None = None

    @property
    def query_len(self) -> int:
        """Tokens per sequence in a verify step: the last accepted one plus the drafts."""
        return self.num_speculative_tokens + 1


def parse_speculative_config(value: str | Mapping[str, Any]) -> SpeculativeSettings:
    """vLLM's dict (or its JSON text) -> settings; a ValueError names what is wrong."""
    where = "--speculative-config"
    if isinstance(value, str):
        try:
            data = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"{where}: not valid JSON ({exc})") from None
    else:
        data = dict(value)
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a JSON object")
    unknown = sorted(set(data) - _KEYS)
    if unknown:
        raise ValueError(f"{where}: unsupported key(s) {', '.join(unknown)} (supported: "
                         f"{', '.join(sorted(_KEYS))})")
    method = data.get("method")
    model = data.get("model")
    supported = ", ".join(m.value for m in SpecMethod)
    if method is None and model in ("ngram", "[ngram]"):
        method = "ngram"  # vLLM's older spelling: "model": "[ngram]"
    elif method is None and isinstance(model, str) and model:
        # vLLM's rule: a model and no method is a draft model, unless its name says EAGLE
        method = "eagle" if "eagle" in model.lower() else "draft_model"
    if method is None:
        raise ValueError(f"{where}: \"method\" is required (supported: {supported})")
    method = _ALIASES.get(method, method)
    if method in _NOT_YET:
        raise ValueError(f"{where}: method {method!r} is not supported by this server yet "
                         f"(supported: {supported})")
    try:
        spec_method = SpecMethod(method)
    except ValueError:
        raise ValueError(f"{where}: method {method!r} is not supported (supported: "
                         f"{supported})") from None
    if spec_method is SpecMethod.NGRAM and model not in (None, "ngram", "[ngram]"):
        raise ValueError(f"{where}: \"model\" is for a draft model; method ngram takes none")
    if spec_method is SpecMethod.DRAFT_MODEL and (not isinstance(model, str) or not model):
        raise ValueError(f"{where}: method draft_model needs \"model\": the draft "
                         "checkpoint (a smaller model with the target's tokenizer)")
    if spec_method in (SpecMethod.EAGLE, SpecMethod.EAGLE3) and (
            not isinstance(model, str) or not model):
        raise ValueError(f"{where}: method {spec_method} needs \"model\": the {spec_method} "
                         "head's checkpoint folder (vLLM's layout)")
    if data.get("draft_tensor_parallel_size") not in (None, 1):
        raise ValueError(f"{where}: draft_tensor_parallel_size must be 1")
    k = _int(data, "num_speculative_tokens", None)
    lo = _int(data, "prompt_lookup_min", None)
    hi = _int(data, "prompt_lookup_max", None)
    # vLLM's rule: neither given, both 5; one given sets the other
    if lo is None and hi is None:
        lo = hi = 5
    lo = lo if lo is not None else hi
    hi = hi if hi is not None else lo
    assert lo is not None and hi is not None
    disable = _int(data, "disable_by_batch_size", None)
    if k is None or k < 1:
        raise ValueError(f"{where}: num_speculative_tokens must be an integer >= 1")
    if not 1 <= lo <= hi:
        raise ValueError(f"{where}: need 1 <= prompt_lookup_min ({lo}) <= prompt_lookup_max "
                         f"({hi})")
    if disable is not None and disable < 1:
        raise ValueError(f"{where}: disable_by_batch_size must be >= 1")
    if spec_method is SpecMethod.MTP and model is not None and (
            not isinstance(model, str) or not model):
        raise ValueError(f"{where}: method mtp reads the target's own MTP layers: leave "
                         "\"model\" out (or name the target)")
    with_model = spec_method is not SpecMethod.NGRAM
    return SpeculativeSettings(spec_method, k, lo, hi, disable,
                               model if with_model else None)


def _int(data: Mapping[str, Any], key: str, default: int | None) -> int | None:
    value = data.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"--speculative-config: {key} must be an integer, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """``--speculative-config``: vLLM's JSON (the offline ``LLM`` takes the dict)."""

    speculative_config: str | None = flag(
        None, group=GROUP, metavar="JSON",
        help="speculative decoding, vLLM's JSON: {\"method\": \"ngram\", "
             "\"num_speculative_tokens\": K, \"prompt_lookup_min\": N, \"prompt_lookup_max\": "
             "M, \"disable_by_batch_size\": B} or {\"method\": \"draft_model\", \"model\": "
             "PATH, \"num_speculative_tokens\": K}; \"method\": \"eagle\" / \"eagle3\" with "
             "\"model\": an EAGLE head; \"method\": \"mtp\" (DeepSeek-V3's own "
             "multi-token-prediction layer, no \"model\") (verify steps run in warmed "
             "decode buckets of query K + 1)")

    def __post_init__(self) -> None:
        value: Any = self.speculative_config
        if value is not None and not isinstance(value, str):
            # the offline API's dict: kept as JSON text (a frozen, hashable config)
            object.__setattr__(self, "speculative_config", json.dumps(dict(value)))
        self.settings  # noqa: B018 - checked at start-up

    @property
    def settings(self) -> SpeculativeSettings | None:
        if self.speculative_config is None:
            return None
        return parse_speculative_config(self.speculative_config)
