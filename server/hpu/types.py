"""The device layer's shared vocabulary: phases, bucket shapes and the tags around them.

Plain enums, named tuples and dataclasses (no torch), so the pure-Python scheduler can use
them too.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, fields
from typing import Any, NamedTuple


class Phase(str, enum.Enum):
    """What a step computes: whole prompts (prefill) or one token per sequence (decode).

    The values are the label values of the ``phase`` Prometheus label and of the warmup log.
    """

    PREFILL = "prefill"
    DECODE = "decode"

    def __str__(self) -> str:
        return self.value


class SyncPoint(str, enum.Enum):
    """Device work issued outside a model step that a graph runner closes with ``sync``
    (on a device that queues ops lazily) and counts compilations of; the value is its
    ``phase`` label value, beside the step phases."""

    SAMPLER = "sampler"
    # the vision encoder's calls before a prefill (images per call is its bucket)
    ENCODER = "encoder"

    def __str__(self) -> str:
        return self.value


# What a compilation is counted under: a step phase, or work outside the step (sampling).
CompileLabel = Phase | SyncPoint


class Stage(str, enum.Enum):
    """Whether the engine is warming up or serving (the ``stage`` label of compilations:
    "zero compilations while serving" is the promise)."""

    WARMUP = "warmup"
    SERVING = "serving"

    def __str__(self) -> str:
        return self.value


class DecodeLayout(str, enum.Enum):
    """How the KV blocks of a batch reach attention, whichever the layer ops read: a flat
    block list with a one-hot block mapping (vLLM Gaudi's flat paged attention), or per-row
    block tables (the fused CPU kernel)."""

    FLAT = "flat"
    BLOCK_TABLES = "block_tables"

    def __str__(self) -> str:
        return self.value


class Bucket(NamedTuple):
    """A planned (padded) shape; its fields read per phase.

    * prefill: ``batch`` rows, ``query`` tokens per row (the padded prompt chunk), ``blocks``
      the context blocks the queries follow in the cache (a cached prefix, earlier chunks;
      0 for a fresh prompt);
    * decode: ``batch`` rows, ``query`` 1, ``blocks`` the whole batch's KV blocks.
    """

    batch: int
    query: int
    blocks: int

    def __repr__(self) -> str:
        # as a plain tuple: the plan and warmup logs, and bucket files, keep their format
        return tuple.__repr__(self)


@dataclass(frozen=True, slots=True)
class BucketLimits:
    """The engine limits a bucket plan lives within (``limits`` of the observed-shapes
    document). ``None``: not known (a document that did not record it)."""

    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    num_blocks: int | None = None

    def to_json(self) -> dict[str, int]:
        """The known limits, keyed by field name."""
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> BucketLimits:
        return cls(**{f.name: int(doc[f.name]) for f in fields(cls)
                      if doc.get(f.name) is not None})
