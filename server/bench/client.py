"""One streamed request against an OpenAI-compatible server, timed chunk by chunk."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from server.bench.workload import BenchRequest


@dataclass(slots=True)
class RequestResult:
    """What one request measured. Times are seconds; ``itl`` holds the gaps between
    content-bearing chunks after the first."""

    ok: bool
    prompt_len: int
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    text: str = ""
    error: str = ""


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where and how to send requests."""

    base_url: str
    model: str
    api: str = "completions"  # or "chat"
    api_key: str | None = None
    ignore_eos: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        path = "/v1/chat/completions" if self.api == "chat" else "/v1/completions"
        return self.base_url.rstrip("/") + path

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def body(self, req: BenchRequest, history: list[tuple[str, str]] | None = None
             ) -> dict[str, Any]:
        """The request's JSON; ``history``: earlier (user, assistant) turns of its
        conversation, resent before its own text (chat only)."""
        body: dict[str, Any] = {
            "model": self.model, "max_tokens": req.output_len, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True},
        }
        if self.api == "chat":
            body["messages"] = [m for user, answer in history or ()
                                for m in ({"role": "user", "content": user},
                                          {"role": "assistant", "content": answer})]
            body["messages"].append({"role": "user", "content": req.prompt})
        else:
            body["prompt"] = req.prompt
        if self.ignore_eos:
            body["ignore_eos"] = True  # vLLM / llama.cpp extension; others ignore it
        body.update(self.extra_body)
        return body


def _delta_text(chunk: dict[str, Any]) -> str:
    parts = []
    for choice in chunk.get("choices") or []:
        if "delta" in choice:
            parts.append((choice["delta"] or {}).get("content") or "")
        else:
            parts.append(choice.get("text") or "")
    return "".join(parts)


async def send(client: httpx.AsyncClient, endpoint: Endpoint, req: BenchRequest,
               history: list[tuple[str, str]] | None = None) -> RequestResult:
    """Streams one request; never raises (a failure is a result with ``ok=False``). The
    prompt length becomes the server's count when it reports usage (a multi-turn request's
    prompt holds its whole history)."""
    result = RequestResult(ok=False, prompt_len=req.prompt_len)
    start = last = time.perf_counter()
    chunks = 0
    usage_tokens: int | None = None
    try:
        async with client.stream("POST", endpoint.url, json=endpoint.body(req, history),
                                 headers=endpoint.headers()) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {body[:300]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens", usage_tokens)
                    result.prompt_len = chunk["usage"].get("prompt_tokens") or result.prompt_len
                text = _delta_text(chunk)
                if not text:
                    continue
                now = time.perf_counter()
                if chunks == 0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
                chunks += 1
                result.text += text
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.latency = time.perf_counter() - start
    # Servers that report usage are exact; otherwise one content chunk ~ one token.
    result.output_tokens = usage_tokens if usage_tokens is not None else chunks
    result.ok = chunks > 0
    if not result.ok:
        result.error = "no content streamed"
    return result
