"""The Responses API's store (``/v1/responses``): how many stored responses are kept, and
for how long. vLLM has no equivalent (its store is unbounded and off by default)."""

from __future__ import annotations

from dataclasses import dataclass

from server.config.fields import flag, option

RESPONSES = "Responses API store"


@dataclass(frozen=True, slots=True)
class ResponsesStoreConfig:
    """Bounds of the in-memory store behind ``store``, ``previous_response_id``, retrieve and
    background responses: a response is kept while it is among the newest ``max_entries``
    and younger than ``ttl_s``; past that it is evicted, and a client asking for it is told
    so (404 naming the bound), unlike for an id that never existed."""

    max_entries: int = flag(1000, name="responses-store-max-entries", group=RESPONSES,
                            help="stored responses kept (the oldest finished one is evicted "
                                 "first; running background responses are never evicted)")
    ttl_s: float = flag(3600.0, name="responses-store-ttl-s", group=RESPONSES,
                        help="seconds a stored response is kept after it finished")

    def __post_init__(self) -> None:
        if self.max_entries < 1:
            raise ValueError(f"{option(type(self), 'max_entries')} must be >= 1")
        if self.ttl_s <= 0:
            raise ValueError(f"{option(type(self), 'ttl_s')} must be > 0")
