"""Drives a workload against an endpoint: arrivals, a concurrency cap, a progress bar."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import httpx
from tqdm import tqdm

from server.bench.client import Endpoint, RequestResult, send
from server.bench.report import BenchSummary, summarize
from server.bench.workload import BenchRequest, arrival_gaps


async def run_workload(
    endpoint: Endpoint,
    requests: Sequence[BenchRequest],
    request_rate: float = float("inf"),
    max_concurrency: int | None = None,
    seed: int = 0,
    burstiness: float = 1.0,
    progress: bool = True,
    timeout_s: float = 3600.0,
) -> tuple[BenchSummary, list[RequestResult]]:
    """Sends every request (arrivals by ``request_rate``, at most ``max_concurrency`` in
    flight) and returns the summary plus per-request results in workload order."""
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(requests), disable=not progress, desc="requests", unit="req")
    connections = max_concurrency or len(requests) or 1
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)

    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:
        async def one(req: BenchRequest) -> RequestResult:
            if limit is None:
                result = await send(client, endpoint, req)
            else:
                async with limit:
                    result = await send(client, endpoint, req)
            bar.update(1)
            return result

        start = time.perf_counter()
        tasks = []
        for req, gap in zip(requests, arrival_gaps(request_rate, len(requests), seed, burstiness)):
            if gap > 0:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(req)))
        results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - start
    bar.close()
    return summarize(results, duration), results


async def discover_model(base_url: str, api_key: str | None = None) -> str:
    """The first model the server lists at /v1/models."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=30) as client:
        response = await client.get(base_url.rstrip("/") + "/v1/models", headers=headers)
        response.raise_for_status()
        return response.json()["data"][0]["id"]
