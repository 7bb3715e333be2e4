"""A batch file's requests sent through the server's own app, in process (no port): each
line gets the answer ``/v1/chat/completions`` (or the route it names) would give over HTTP,
with the same checks, defaults, admission and request log.

At most ``concurrency`` requests are in flight (the engine batches them); one refused for
load (429 / 503 with ``Retry-After``) waits and is sent again, so a batch larger than
``--max-waiting-requests`` still completes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from typing import Any

import httpx
from fastapi import FastAPI

from server.api.batch.protocol import (
    BATCH_URLS,
    BatchRequestInput,
    BatchRequestOutput,
    answered,
    refused,
)

logger = logging.getLogger(__name__)

# the longest wait a Retry-After is taken for (the server's own say 1-5 s)
MAX_RETRY_WAIT_S = 10.0


async def run_batch(app: FastAPI, requests: list[BatchRequestInput], *, concurrency: int,
                    api_key: str | None = None) -> list[BatchRequestOutput]:
    """The answer line of each request, in their order; the app's lifespan (engine loop,
    workers) runs around them."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    gate = asyncio.Semaphore(max(1, concurrency))
    done = 0

    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 0))
        async with httpx.AsyncClient(transport=transport, base_url="http://run-batch",
                                     headers=headers, timeout=None) as client:

            async def one(request: BatchRequestInput) -> BatchRequestOutput:
                nonlocal done
                async with gate:
                    out = await _answer(client, request)
                done += 1
                if done % 100 == 0 or done == len(requests):
                    logger.info("run-batch: %d of %d requests answered", done, len(requests))
                return out

            return list(await asyncio.gather(*(one(r) for r in requests)))


async def _answer(client: httpx.AsyncClient, request: BatchRequestInput) -> BatchRequestOutput:
    if request.method.upper() != "POST":
        return refused(request, 400, f"method {request.method} is not supported: batch "
                                     "requests are POST")
    if request.url not in BATCH_URLS:
        return refused(request, 400, f"URL {request.url} was used. Supported endpoints: "
                                     + ", ".join(BATCH_URLS))
    if request.body.get("stream") not in (None, False, "false", "False"):
        return refused(request, 400, "Only non-streaming mode is supported.")
    request_id = f"vllm-batch-{uuid.uuid4().hex}"
    while True:
        response = await client.post(request.url, json=request.body,
                                     headers={"X-Request-Id": request_id})
        wait = _retry_after(response)
        if wait is None:
            break
        await asyncio.sleep(wait)
    body = _json(response)
    request_id = response.headers.get("X-Request-Id", request_id)
    if response.status_code != 200:
        return refused(request, response.status_code, body, request_id)
    return answered(request, body, request_id)


def _retry_after(response: httpx.Response) -> float | None:
    """Seconds to wait before sending it again, when the server refused it for load only."""
    if response.status_code not in (429, 503) or "Retry-After" not in response.headers:
        return None
    try:
        return min(MAX_RETRY_WAIT_S, max(0.05, float(response.headers["Retry-After"])))
    except ValueError:
        return 1.0


def _json(response: httpx.Response) -> Any:
    try:
        return response.json()
    except json.JSONDecodeError:
        return response.text
