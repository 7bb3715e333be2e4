"""Sleep mode's vocabulary (``--enable-sleep-mode``), free of torch so the API can use it.

Level 1 keeps the weights in host memory and drops the KV cache; level 2 drops both (the
weights are read again from the model files at wake). A wake may restore part of what
sleep freed (``tags``): the weights first, then the KV cache, as an RL loop does around a
weight update.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable


class SleepLevel(enum.IntEnum):
    """What ``POST /sleep?level=`` frees."""

    OFFLOAD = 1  # weights to host memory (kept where they already are, on CPU), KV dropped
    DISCARD = 2  # weights and KV cache dropped; weights reloaded from the files at wake


class WakeTag(str, enum.Enum):
    """What ``POST /wake_up?tags=`` restores (vLLM's tag names)."""

    WEIGHTS = "weights"
    KV_CACHE = "kv_cache"

    def __str__(self) -> str:
        return self.value


ALL_TAGS: frozenset[WakeTag] = frozenset(WakeTag)


def parse_level(value: int) -> SleepLevel:
    """``level`` of ``POST /sleep``; a ValueError naming the accepted values."""
    try:
        return SleepLevel(value)
    except ValueError:
        raise ValueError(f"level must be 1 or 2, got {value}") from None


def parse_tags(values: Iterable[str] | None) -> frozenset[WakeTag]:
    """``tags`` of ``POST /wake_up`` (none: everything); a ValueError naming the known ones."""
    if not values:
        return ALL_TAGS
    tags: set[WakeTag] = set()
    for value in values:
        for part in value.split(","):
            try:
                tags.add(WakeTag(part.strip()))
            except ValueError:
                known = ", ".join(t.value for t in WakeTag)
                raise ValueError(f"unknown tag {part.strip()!r} (known: {known})") from None
    return frozenset(tags)
