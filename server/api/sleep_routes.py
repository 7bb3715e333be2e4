"""Sleep mode's admin endpoints (``--enable-sleep-mode``, behind ``--api-key``): vLLM's
``POST /sleep``, ``POST /wake_up``, ``GET /is_sleeping``, and ``POST /reload_weights``.

Without the flag the routes do not exist (404, as vLLM hides them). Requests that arrive
while the engine sleeps are answered 503 with ``Retry-After`` at once, flag or not.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from server.api.errors import APIError, error_response
from server.engine.errors import EngineSleepingError
from server.engine.sleep import SleepLevel, WakeTag, parse_level, parse_tags

# Waking takes seconds (a level 2 wake reads the weights again): no use retrying sooner.
SLEEP_RETRY_AFTER_S = 5


@runtime_checkable
class SleepClient(Protocol):
    """What the routes need from the engine (``AsyncEngine`` provides it)."""

    @property
    def sleep_mode_enabled(self) -> bool: ...

    @property
    def is_sleeping(self) -> bool: ...

    async def sleep(self, level: SleepLevel) -> int: ...

    async def wake_up(self, tags: frozenset[WakeTag]) -> bool: ...

    async def reload_weights(self, path: str) -> None: ...


class SleepResponse(BaseModel):
    is_sleeping: bool
    level: int | None = None  # the level just applied (POST /sleep)
    aborted_requests: int = 0  # requests in flight at /sleep, ended with finish_reason abort


class IsSleepingResponse(BaseModel):
    is_sleeping: bool


class ReloadWeightsRequest(BaseModel):
    path: str = Field(min_length=1, description="a model folder (config.json + safetensors) "
                                                "or .gguf file of the served architecture")


class ReloadWeightsResponse(BaseModel):
    status: str = "ok"
    path: str


def add_sleep_routes(app: FastAPI, engine: object) -> None:
    """The sleep endpoints where ``engine`` runs with ``--enable-sleep-mode``; the 503 for
    requests that meet a sleeping engine in any case."""

    @app.exception_handler(EngineSleepingError)
    async def _sleeping(_: Request, exc: EngineSleepingError) -> JSONResponse:
        return error_response(503, str(exc), code="engine_sleeping",
                              headers={"Retry-After": str(SLEEP_RETRY_AFTER_S)})

    if not isinstance(engine, SleepClient) or not engine.sleep_mode_enabled:
        return
    client: SleepClient = engine

    @app.post("/sleep", response_model=SleepResponse)
    async def sleep(level: int = Query(1, description="1: weights to host memory, KV cache "
                                                      "dropped; 2: both dropped")
                    ) -> SleepResponse:
        """Frees the KV cache and the weights; requests in flight are aborted."""
        try:
            chosen = parse_level(level)
        except ValueError as exc:
            raise APIError(400, str(exc), "level") from None
        aborted = await client.sleep(chosen)
        return SleepResponse(is_sleeping=True, level=int(chosen), aborted_requests=aborted)

    @app.post("/wake_up", response_model=IsSleepingResponse)
    async def wake_up(tags: list[str] | None = Query(None, description="weights, kv_cache "
                                                                        "(none: both)")
                      ) -> IsSleepingResponse:
        """Restores the weights and the KV cache (or what ``tags`` name)."""
        try:
            chosen = parse_tags(tags)
        except ValueError as exc:
            raise APIError(400, str(exc), "tags") from None
        return IsSleepingResponse(is_sleeping=await client.wake_up(chosen))

    @app.get("/is_sleeping", response_model=IsSleepingResponse)
    async def is_sleeping() -> IsSleepingResponse:
        return IsSleepingResponse(is_sleeping=client.is_sleeping)

    @app.post("/reload_weights", response_model=ReloadWeightsResponse)
    async def reload_weights(body: ReloadWeightsRequest) -> ReloadWeightsResponse:
        """Swaps in the weights at ``path`` (same architecture and shapes), in place."""
        await client.reload_weights(body.path)
        return ReloadWeightsResponse(path=body.path)
