"""Per-request generation settings, validated once at submission."""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

logger = logging.getLogger(__name__)

# Largest top-k logprobs a request may ask for (OpenAI allows 20 on chat).
MAX_LOGPROBS = 20
# Smallest temperature above 0 (vLLM's): logits / 1e-300 are inf or NaN in fp32, and the
# sampler would draw a token outside top-k, top-p or a grammar's mask.
MIN_TEMPERATURE = 1e-2


class StructuredOutputsParams(BaseModel):
    """One constraint on the generated text (vLLM's ``structured_outputs``): exactly one of
    a JSON schema, any JSON object, a regex, a choice of strings, an EBNF grammar."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    # ``json`` in vLLM's API (a name pydantic models keep for themselves)
    json_schema: str | dict[str, Any] | None = Field(None, alias="json")
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    # The request field this came from, for error messages (response_format, guided_json...)
    field: str = "structured_outputs"
    # With a reasoning parser: the constraint starts after this text (e.g. "</think>")
    start_after: str | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputsParams:
        given = [name for name in ("json_schema", "regex", "choice", "grammar")
                 if getattr(self, name) is not None] + (["json_object"] if self.json_object
                                                        else [])
        if len(given) != 1:
            raise ValueError("structured_outputs needs exactly one of json, json_object, "
                             f"regex, choice, grammar (got {given or 'none'})")
        if self.choice is not None and not self.choice:
            raise ValueError("structured_outputs.choice must not be empty")
        return self

    @property
    def kind(self) -> str:
        if self.json_schema is not None:
            return "JSON schema"
        if self.json_object:
            return "JSON object"
        return "regex" if self.regex is not None else (
            "choice" if self.choice is not None else "grammar")


class SamplingParams(BaseModel):
    """How to pick tokens and when to stop, for one request.

    Validation errors are pydantic ``ValidationError`` (a ``ValueError``) whose message names
    the offending field, so both the offline API and the HTTP layer can report them as-is.
    """

    model_config = ConfigDict(extra="forbid", strict=False, validate_assignment=True)

    n: int = Field(1, ge=1, le=128, description="completions to generate per prompt")
    # Scheduling, not sampling, but it travels with the request's settings through every
    # entry point (HTTP, offline LLM): with --scheduling-policy priority, lower runs first.
    priority: int = Field(0, ge=-(2**63), le=2**63 - 1)
    # Not sampling either: vLLM's cache_salt. It enters the hash of the request's first KV
    # block, so prompts with different salts never share cached blocks (tenant isolation).
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)
    # vLLM's: keep only the prompt's last k tokens (-1: as many as the context holds beside
    # max_tokens, or beside one token when it is unset)
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    # which end of the prompt truncate_prompt_tokens keeps: "left" cuts the start (the last
    # tokens stay, the default), "right" cuts the end (vLLM's truncation_side)
    truncation_side: Literal["left", "right"] = "left"
    max_tokens: int | None = Field(16, ge=1, description="None: up to the context length")
    # int32 bounds (here and on top_k): beyond them a value is a typo, and a top_k of 2**63
    # would overflow the sampler's int64 tensor
    min_tokens: int = Field(0, ge=0, le=2**31 - 1,
                            description="EOS and stop conditions ignored before this")
    temperature: float = Field(1.0, ge=0.0, description="0 means greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, le=2**31 - 1, description="-1 or 0 disables")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    # OpenAI's range (int64); the generator takes no more.
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0 * 10)
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="None: no logprobs; k: sampled + top-k"
    )
    # vLLM's: per prompt position, the logprob of the prompt's own token and the top k
    # (the front end bounds k with --max-logprobs). Such a request never reads the prefix
    # cache: logits of cached positions were never computed (vLLM's choice too).
    prompt_logprobs: int | None = Field(None, ge=0)
    # vLLM's: words never generated (a single-token word is banned outright; a longer one
    # bans its last token after its other tokens were generated)
    bad_words: list[str] = Field(default_factory=list)
    # bad_words as token ids, filled by the input processor (each word with and without a
    # leading space, as vLLM tokenizes them)
    bad_words_token_ids: list[list[int]] = Field(default_factory=list)
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    # vLLM's: only these tokens may be sampled (the logprobs reported are over them)
    allowed_token_ids: list[int] | None = Field(None, min_length=1)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: object) -> object:
        if value is None:
            return []
        if isinstance(value, str):
            return [value]
        return value

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, value: list[str]) -> list[str]:
        if any(s == "" for s in value):
            raise ValueError("stop strings must not be empty")
        return value

    @field_validator("temperature")
    @classmethod
    def _temperature_floor(cls, value: float) -> float:
        if 0.0 < value < MIN_TEMPERATURE:
            logger.warning("temperature %g is below %g, where logits overflow: raised to %g",
                           value, MIN_TEMPERATURE, MIN_TEMPERATURE)
            return MIN_TEMPERATURE
        return value

    @field_validator("top_k")
    @classmethod
    def _top_k_range(cls, value: int) -> int:
        if value < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {value}")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, value: dict[int, float] | None) -> dict[int, float] | None:
        if value:
            for token_id, bias in value.items():
                if not -100.0 <= bias <= 100.0:
                    raise ValueError(f"logit_bias for token {token_id} must be in [-100, 100]")
        return value

    @model_validator(mode="after")
    def _min_below_max(self) -> SamplingParams:
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        return self
