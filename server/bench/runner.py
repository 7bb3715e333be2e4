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
    flight) and returns the summary plus per-request results in workload order. The turns of
    a conversation arrive as one: each is sent when the previous one's answer is in."""
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(requests), disable=not progress, desc="requests", unit="req")
    connections = max_concurrency or len(requests) or 1
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)

    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:
        async def one(req: BenchRequest, history: list[tuple[str, str]] | None = None
                      ) -> RequestResult:
            if limit is None:
                result = await send(client, endpoint, req, history)
            else:
                async with limit:
                    result = await send(client, endpoint, req, history)
            bar.update(1)
            return result

        async def conversation(turns: list[BenchRequest]) -> list[RequestResult]:
            # each turn waits for the previous answer and resends the whole history
            history: list[tuple[str, str]] = []
            results = []
            for req in turns:
                result = await one(req, history)
                results.append(result)
                history.append((req.prompt, result.text))
            return results

        start = time.perf_counter()
        units = _units(requests)  # a request alone, or a conversation's turns in order
        tasks = []
        for unit, gap in zip(units, arrival_gaps(request_rate, len(units), seed, burstiness)):
            if gap > 0:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(conversation(unit)))
        by_unit = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    bar.close()
    order = {id(req): i for i, req in enumerate(requests)}
    results: list[RequestResult] = [None] * len(requests)  # type: ignore[list-item]
    for unit, unit_results in zip(units, by_unit):
        for req, result in zip(unit, unit_results):
            results[order[id(req)]] = result
    return summarize(results, duration), results


def _units(requests: Sequence[BenchRequest]) -> list[list[BenchRequest]]:
    """Requests grouped into what arrives together: a conversation's turns (by turn), or a
    single request; in order of first appearance."""
    units: list[list[BenchRequest]] = []
    conversations: dict[int, list[BenchRequest]] = {}
    for req in requests:
        if req.conversation is None:
            units.append([req])
        elif req.conversation in conversations:
            conversations[req.conversation].append(req)
        else:
            conversations[req.conversation] = [req]
            units.append(conversations[req.conversation])
    for unit in units:
        unit.sort(key=lambda r: r.turn)
    return units


async def discover_model(base_url: str, api_key: str | None = None) -> str:
    """The first model the server lists at /v1/models."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=30) as client:
        response = await client.get(base_url.rstrip("/") + "/v1/models", headers=headers)
        response.raise_for_status()
        return response.json()["data"][0]["id"]
