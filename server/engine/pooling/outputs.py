"""What a pooling request gets back: one result, in one (final) output.

A leaf module (no torch): the API imports it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from server.engine.outputs import RequestOutput


@dataclass(slots=True)
class PoolingRequestOutput(RequestOutput):
    """A request output with no completions: ``data`` is the embedding, or the class
    probabilities / score of a classifier."""

    data: list[float] = field(default_factory=list)
