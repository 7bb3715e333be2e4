"""Client A's six attacks for benchmarks/abuse.py (issue 33's table), from 127.0.0.2.

Each attack is ``attack(url, model, scale, tally)``: it sends its requests, counts what they
got in ``tally`` (HTTP statuses, or what became of its connections) and returns when they are
all answered. The caller bounds its time. ``scale`` multiplies the counts (never below 1).
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Awaitable, Callable
from urllib.parse import urlparse

import httpx

ATTACKER = "127.0.0.2"  # client A's source address (loopback only)
MB15 = 15 * 1000 * 1000


def scaled(n: int, scale: float) -> int:
    return max(1, round(n * scale))


def label(exc: BaseException) -> str:
    return "timeout" if isinstance(exc, httpx.TimeoutException) else type(exc).__name__


def attacker(connections: int = 100, timeout: float = 600) -> httpx.AsyncClient:
    transport = httpx.AsyncHTTPTransport(
        local_address=ATTACKER,
        limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections))
    return httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(timeout, connect=30))


async def post(client: httpx.AsyncClient, url: str, body: dict, tally: collections.Counter,
               stream: bool = False) -> None:
    try:
        if stream:
            async with client.stream("POST", url, json=body) as resp:
                async for _ in resp.aiter_bytes():
                    pass
        else:
            resp = await client.post(url, json=body)
        tally[resp.status_code] += 1
    except httpx.HTTPError as exc:
        tally[label(exc)] += 1


async def grammars(url: str, model: str, scale: float, tally: collections.Counter) -> None:
    enum = {"type": "object", "properties": {"pick": {
        "enum": [f"value-{i}" for i in range(scaled(50_000, scale))]}}, "required": ["pick"]}
    recursive = {"$defs": {"node": {"type": "object", "properties": {
        "name": {"type": "string"},
        "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
        "required": ["name", "children"]}}, "$ref": "#/$defs/node"}
    regex = r"((a|b+)*(c+d*)+)+(e?[a-z]{1,20}(f|g+)*)*z"

    def chat(extra: dict) -> dict:
        return {"model": model, "max_tokens": 16, "messages": [
            {"role": "user", "content": "Answer in the required format."}], **extra}

    def schema(name: str, s: dict) -> dict:
        return chat({"response_format": {"type": "json_schema",
                                         "json_schema": {"name": name, "schema": s}}})

    bodies = [schema("enum", enum)] * 4 + [schema("tree", recursive)] * 4 + \
        [chat({"structured_outputs": {"regex": regex}})] * 4
    async with attacker() as client:
        await asyncio.gather(*(post(client, url + "/v1/chat/completions", b, tally)
                               for b in bodies))


async def idle_connections(url: str, model: str, scale: float, tally: collections.Counter,
                           seconds: float) -> None:
    host, port = urlparse(url).hostname, urlparse(url).port or 80
    deadline = time.monotonic() + seconds

    async def hold() -> None:
        while time.monotonic() < deadline:
            try:
                reader, writer = await asyncio.wait_for(asyncio.open_connection(
                    host, port, local_addr=(ATTACKER, 0)), 10)
            except (OSError, asyncio.TimeoutError) as exc:
                tally["connect-" + type(exc).__name__] += 1
                await asyncio.sleep(0.2)
                continue
            tally["opened"] += 1
            try:  # nothing sent; wait for the server to close it (EOF), then reopen
                await asyncio.wait_for(reader.read(), max(0.1, deadline - time.monotonic()))
                tally["closed"] += 1
            except (OSError, asyncio.TimeoutError):
                pass
            finally:
                writer.close()

    await asyncio.gather(*(hold() for _ in range(scaled(1000, scale))))


async def tokenize(url: str, model: str, scale: float, tally: collections.Counter) -> None:
    big_prompt = {"model": model, "prompt": "hello world " * (scaled(MB15, scale) // 12)}
    many = {"model": model, "messages": [{"role": "user", "content": "hi"}] *
            scaled(300_000, scale)}
    async with attacker() as client:
        await asyncio.gather(post(client, url + "/tokenize", big_prompt, tally),
                             post(client, url + "/tokenize", many, tally))


async def big_answer(url: str, model: str, scale: float, tally: collections.Counter) -> None:
    body = {"model": model, "n": scaled(128, scale), "max_tokens": 512, "logprobs": True,
            "top_logprobs": 20, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Tell me a long story."}]}
    async with attacker() as client:
        await post(client, url + "/v1/chat/completions", body, tally)


async def fan_out(url: str, model: str, scale: float, tally: collections.Counter) -> None:
    prompts = [f"Story number {i}:" for i in range(scaled(128, scale))]
    body = {"model": model, "prompt": prompts, "n": 128, "max_tokens": 8, "ignore_eos": True}
    async with attacker() as client:
        await post(client, url + "/v1/completions", body, tally)


async def streams(url: str, model: str, scale: float, tally: collections.Counter) -> None:
    n = scaled(500, scale)
    body = {"model": model, "max_tokens": 64, "ignore_eos": True, "stream": True,
            "messages": [{"role": "user", "content": "Count to one hundred."}]}
    async with attacker(connections=n) as client:
        await asyncio.gather(*(post(client, url + "/v1/chat/completions", body, tally,
                                    stream=True) for _ in range(n)))


Attack = Callable[[str, str, float, collections.Counter], Awaitable[None]]
