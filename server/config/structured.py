"""Structured outputs: which grammar backend, and the bounds on grammar work."""

from __future__ import annotations

import enum
import importlib.util
from dataclasses import dataclass

from server.config.fields import flag, option

GRAMMAR = "grammar bounds (beyond them: 400 naming the field)"


class StructuredOutputsBackend(str, enum.Enum):
    """The grammar engines this server has (``--structured-outputs-backend``); vLLM's others
    (guidance, outlines, lm-format-enforcer) are refused at start-up."""

    AUTO = "auto"  # xgrammar, the only one
    XGRAMMAR = "xgrammar"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class StructuredOutputsConfig:
    """Bounds on grammar work (a JSON schema, regex, choice or EBNF from a request is compiled
    on the server's CPU): beyond them the request gets a 400 naming the field and the limit."""

    backend: StructuredOutputsBackend = flag(
        StructuredOutputsBackend.AUTO, name="structured-outputs-backend",
        # vLLM's older name, and its dotted --structured-outputs-config.backend
        aliases=("--guided-decoding-backend", "--structured-outputs-config.backend"),
        help="grammar engine of response_format / guided_* / structured_outputs (auto: "
             "xgrammar)")
    compile_timeout: float = flag(10.0, name="grammar-compile-timeout", group=GRAMMAR,
                                  help="seconds one grammar may take to compile")
    max_bytes: int = flag(65536, name="max-grammar-bytes", group=GRAMMAR,
                          help="size of one schema, regex, grammar or choice list")
    max_alternatives: int = flag(
        1024, name="max-grammar-alternatives", group=GRAMMAR,
        help="enum values, choices or anyOf/oneOf branches in one constraint")
    workers: int = flag(2, name="grammar-workers", group=GRAMMAR,
                        help="grammars compiled at once, in their own pool (tokenizing never "
                             "waits for them)")
    cache_size: int = flag(256, name="grammar-cache-size", group=GRAMMAR,
                           help="compiled grammars kept for reuse (least recently used dropped)")

    def __post_init__(self) -> None:
        try:
            backend = StructuredOutputsBackend(self.backend)
        except ValueError:
            have = ", ".join(b.value for b in StructuredOutputsBackend)
            raise ValueError(f"--structured-outputs-backend {self.backend}: this server has "
                             f"no such grammar backend (it has: {have})") from None
        object.__setattr__(self, "backend", backend)
        # checked here, not on the first guided request, so that serving never starts
        # without the grammar engine it was asked for
        if importlib.util.find_spec(self.resolved_backend.value) is None:
            raise ValueError(f"--structured-outputs-backend {backend}: the "
                             f"{self.resolved_backend} package is not installed")
        if self.compile_timeout <= 0:
            raise ValueError(f"{option(type(self), 'compile_timeout')} must be > 0")
        for name in ("max_bytes", "max_alternatives", "workers", "cache_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{option(type(self), name)} must be >= 1")

    @property
    def resolved_backend(self) -> StructuredOutputsBackend:
        """The backend that compiles grammars (``auto`` resolved)."""
        if self.backend is StructuredOutputsBackend.AUTO:
            return StructuredOutputsBackend.XGRAMMAR
        return self.backend
