"""Admission limits in front of the engine: sequences per client (``--max-client-seqs``, 429)
and the bound on the waiting queue (``--max-waiting-requests``, 503), both with
``Retry-After``.

A client's sequences count from admission until the request's stream ends, whichever way
it ends (finished, aborted, failed, the client gone, or never read at all): a count that
leaked would lock that client out for good.
"""

from __future__ import annotations

import weakref
from collections.abc import AsyncIterator, Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import CollectorRegistry

from server.api.errors import APIError
from server.engine.outputs import RequestOutput

# Seconds a refused client is told to wait: a slot frees as soon as any request ends, which
# on a busy server is a matter of steps, not minutes (the openai SDK honours the header)
RETRY_AFTER_S = 1


class Lease:
    """One request's hold on its client's sequence count; released exactly once."""

    def __init__(self, owner: ClientSeqs, client: str, num_seqs: int) -> None:
        self._owner = owner
        self.client = client
        self.num_seqs = num_seqs
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._owner._release(self.client, self.num_seqs)


class ClientSeqs:
    """Sequences each client has in the engine (waiting or running), keyed by the
    ``--fair-share`` client key.

    ``limit`` (``--max-client-seqs``, 0: none): a request that would take its client past
    it is answered 429. With ``fair`` on, a full waiting queue refuses only the clients
    holding at least their share of it (the bound over the clients holding sequences): a
    client that floods the queue does not get everyone else a 503, and the queue still
    stays within twice its bound.
    """

    def __init__(self, limit: int = 0, fair: bool = False,
                 registry: CollectorRegistry | None = None) -> None:
        self.limit = limit
        self.fair = fair
        self._held: dict[str, int] = {}
        if registry is not None:
            registry.register(_Collector(self))

    def held(self, client: str) -> int:
        return self._held.get(client, 0)

    @property
    def total(self) -> int:
        return sum(self._held.values())

    @property
    def num_clients(self) -> int:
        return len(self._held)

    def admit(self, client: str, num_seqs: int, num_waiting: int,
              max_waiting: int) -> Lease:
        """Counts ``num_seqs`` more for ``client``, or raises 429 (its limit) / 503 (the
        waiting queue is full, ``max_waiting`` 0: unbounded)."""
        held = self.held(client)
        if self.limit and held + num_seqs > self.limit:
            raise APIError(429, f"this client already has {held} sequences in the engine; "
                                f"{num_seqs} more would pass --max-client-seqs {self.limit}; "
                                "retry after one of its requests ends",
                           code="rate_limit_exceeded", headers=retry_after())
        if max_waiting and num_waiting >= max_waiting and not self._under_share(
                client, max_waiting):
            raise APIError(503, f"the server is overloaded: {max_waiting} requests are "
                                "already waiting; retry later", headers=retry_after())
        self._held[client] = held + num_seqs
        return Lease(self, client, num_seqs)

    def _under_share(self, client: str, max_waiting: int) -> bool:
        if not self.fair:
            return False
        clients = len(self._held) + (client not in self._held)
        return self.held(client) < max_waiting // clients

    def _release(self, client: str, num_seqs: int) -> None:
        left = self._held.get(client, 0) - num_seqs
        if left > 0:
            self._held[client] = left
        else:
            self._held.pop(client, None)


def retry_after() -> dict[str, str]:
    return {"Retry-After": str(RETRY_AFTER_S)}


class AdmittedStream:
    """A request's engine stream that releases its lease when it ends: iteration done,
    failed or closed (a client that left), or the stream dropped unread (a multi-prompt
    request refused after its first prompts were queued)."""

    def __init__(self, stream: Any, lease: Lease) -> None:
        self._stream = stream
        self._lease = lease
        weakref.finalize(self, lease.release)

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        try:
            async for out in self._stream:
                yield out
        finally:
            self._lease.release()


class _Collector:
    """/metrics: the sequences counted against clients, and how many clients hold any."""

    def __init__(self, seqs: ClientSeqs) -> None:
        self._seqs = seqs

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily("hpu_serve:client_sequences", "Sequences admitted and not "
                                "yet ended, over every client (--max-client-seqs counts "
                                "these per client).", value=self._seqs.total)
        yield GaugeMetricFamily("hpu_serve:clients_active", "Clients with sequences in the "
                                "engine.", value=self._seqs.num_clients)
