"""Request defaults from the model's generation config (``--generation-config``, vLLM's rule).

A request field left unset (None) takes the model creator's value where the generation
config has one, else the API's neutral default; a field the request sets always wins. Every
endpoint that turns a request into ``SamplingParams`` (chat and text completions, responses,
messages...) resolves its fields through the one ``SamplingDefaults`` the engine holds.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from pydantic import ValidationError

from server.engine.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    """The sampling fields the served model's generation config sets (None: not set)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None  # generation_config.json's max_new_tokens

    @classmethod
    def from_fields(cls, found: Mapping[str, Any], where: str) -> SamplingDefaults:
        """From ``generation_defaults``' dict; a value no request could carry (a negative
        temperature, top_p 0...) is a ValueError naming the field and ``where``."""
        try:
            SamplingParams(**found)
        except ValidationError as exc:
            bad = "; ".join(f"{'.'.join(map(str, e['loc']))} {e['input']!r}: {e['msg']}"
                            for e in exc.errors())
            raise ValueError(f"{where}: {bad}") from None
        return cls(**{f.name: found.get(f.name) for f in fields(cls)})

    def as_dict(self) -> dict[str, float | int]:
        """The fields set, for the start-up log."""
        return {k: v for k, v in asdict(self).items() if v is not None}

    def max_tokens_for(self, requested: int | None) -> int | None:
        """A request's max_tokens: its own, else the model's default (None: up to the
        context length)."""
        return requested if requested is not None else self.max_tokens

    def fill(self, given: Mapping[str, Any]) -> dict[str, Any]:
        """SamplingParams keyword arguments ``given`` (None: the request left it unset),
        each unset one that the generation config sets taken from here. What neither sets
        stays None: the caller leaves it out, so that SamplingParams' own default applies
        (max_tokens None means up to the context length)."""
        out = dict(given)
        for f in fields(self):
            default = getattr(self, f.name)
            if out.get(f.name) is None and default is not None:
                out[f.name] = default
        return out


NO_DEFAULTS = SamplingDefaults()

