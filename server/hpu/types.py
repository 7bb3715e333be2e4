"""The device layer's shared vocabulary: phases and bucket shapes.

Plain enums and aliases (no torch), so the pure-Python scheduler can use them too.
"""

from __future__ import annotations

import enum


class Phase(str, enum.Enum):
    """What a step computes: whole prompts (prefill) or one token per sequence (decode).

    The values are the label values of the ``phase`` Prometheus label and of the warmup log.
    """

    PREFILL = "prefill"
    DECODE = "decode"

    def __str__(self) -> str:
        return self.value


# A planned shape: (batch size, query length, context blocks). Prompt buckets have the
# blocks their queries follow in the cache (a cached prefix, earlier chunks; 0 for a fresh
# prompt); decode buckets have query 1 and the batch's total KV blocks.
Bucket = tuple[int, int, int]
