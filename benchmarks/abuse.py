"""Abuse benchmark: the six one-client outages of issue 33, and what they do to another client.

    python benchmarks/abuse.py                        # starts the embedded model, full sizes
    python benchmarks/abuse.py --scale 0.1 --attack-seconds 40
    python benchmarks/abuse.py --url http://127.0.0.1:8000 --pid 1234 --attacks 2 6

"Client A" (every attack) sends from source address 127.0.0.2; the control client sends
from 127.0.0.1: both are loopback, so with ``--fair-share address`` they are two clients.
Only loopback servers are attacked (``--url`` must point at 127.0.0.0/8).

For each attack, while it runs, a control request (``/v1/completions``, prompt "Hello",
``max_tokens`` 4, a fresh connection each time, as a newly arriving client) is sent again and
again, and /health polled. Printed per attack: the control latency when idle (median of a few)
and during the attack (median, max), the ratio max / idle, the statuses the attack's own
requests got, /health during and after, and the KV cache usage once the server is idle again.
The issue's standard: the ratio stays within 2x (plus one engine step).

The attacks (sizes are the issue's; ``--scale`` shrinks the counts, never below 1):

1. 12 concurrent chat requests with structured outputs: 4 ``json_schema`` with a 50,000-value
   ``enum``, 4 with a recursive ``$ref``, 4 with a nested-quantifier ``structured_outputs.regex``;
2. 1,000 idle TCP connections that send nothing, each reopened when the server closes it;
3. ``POST /tokenize`` with a 15 MB prompt and, at the same time, with 300,000 messages;
4. one non-streamed chat, ``n`` 128, ``max_tokens`` 512, ``top_logprobs`` 20;
5. one completion: 128 prompts x ``n`` 128 x ``max_tokens`` 8;
6. 500 concurrent streams.

Then: ``--dup-rounds`` rounds of two concurrent requests with the same X-Request-Id (both
must answer 200, or one get an immediate 400; none may hang), and the server's RSS after the
first and after ``--rss-requests`` completions with a 15 MB prompt (needs the server's pid).

Every attack stops by itself after ``--attack-seconds``; the script stops the server it
started. Point it at your own server only.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import ipaddress
import json
import os
import resource
import socket
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import httpx
from abuse_attacks import (
    MB15,
    Attack,
    big_answer,
    fan_out,
    grammars,
    idle_connections,
    label,
    scaled,
    streams,
    tokenize,
)
from local_server import start_server, stop_server

CONTROL = {"prompt": "Hello", "max_tokens": 4, "temperature": 0}


@dataclass
class Result:
    number: int
    name: str
    idle_s: float = 0.0
    during_s: list[float] = field(default_factory=list)
    control: collections.Counter = field(default_factory=collections.Counter)
    attack: collections.Counter = field(default_factory=collections.Counter)
    health_during: collections.Counter = field(default_factory=collections.Counter)
    health_after: str = "?"
    kv_after: float | None = None
    attack_s: float = 0.0
    load: float = 0.0  # the machine's 1-minute load average at the end: how noisy it was

    @property
    def ratio(self) -> float:
        return max(self.during_s) / self.idle_s if self.during_s and self.idle_s else float("nan")


def counts(c: collections.Counter) -> str:
    return " ".join(f"{k}:{v}" for k, v in sorted(c.items(), key=lambda kv: str(kv[0]))) or "-"


# --- the server's side: metrics, memory -------------------------------------------------

async def metric(client: httpx.AsyncClient, url: str, name: str) -> float | None:
    try:
        text = (await client.get(url + "/metrics", timeout=10)).text
    except httpx.HTTPError:
        return None
    total = None
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total = (total or 0.0) + float(line.rsplit(" ", 1)[1])
    return total


async def settle(client: httpx.AsyncClient, url: str, seconds: float) -> bool:
    """Waits until nothing runs or waits (bounded): the next attack starts from idle."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        running = await metric(client, url, "vllm:num_requests_running")
        waiting = await metric(client, url, "vllm:num_requests_waiting")
        if running == 0 and waiting == 0:
            return True
        await asyncio.sleep(0.5)
    return False


def rss_mib(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


# --- the control client -------------------------------------------------------------------

async def control_once(url: str, model: str, timeout: float) -> tuple[float, str]:
    # A fresh connection each time: a client arriving during the attack, not one that
    # already holds a keep-alive connection
    async with httpx.AsyncClient(timeout=timeout) as client:
        started = time.monotonic()
        try:
            resp = await client.post(url + "/v1/completions", json={"model": model, **CONTROL})
            status = str(resp.status_code)
        except httpx.HTTPError as exc:
            status = label(exc)
        return time.monotonic() - started, status


async def idle_latency(url: str, model: str, tries: int = 5) -> float:
    return statistics.median([(await control_once(url, model, 30))[0] for _ in range(tries)])


async def watch(url: str, model: str, result: Result, until: asyncio.Event,
                deadline: float) -> None:
    """Control requests back to back, and /health every half second, until the attack ends."""

    async def controls() -> None:
        while not until.is_set() and time.monotonic() < deadline:
            elapsed, status = await control_once(url, model, max(1.0, deadline - time.monotonic()))
            result.during_s.append(elapsed)
            result.control[status] += 1
            await asyncio.sleep(0.05)

    async def health() -> None:
        async with httpx.AsyncClient(timeout=5) as client:
            while not until.is_set() and time.monotonic() < deadline:
                try:
                    status = str((await client.get(url + "/health")).status_code)
                except httpx.HTTPError as exc:
                    status = label(exc)
                result.health_during[status] += 1
                await asyncio.sleep(0.5)

    await asyncio.gather(controls(), health())


def attacks(args: argparse.Namespace) -> dict[int, tuple[str, Attack]]:
    s = args.scale

    async def idle(url: str, model: str, scale: float, tally: collections.Counter) -> None:
        # a little shorter than the cap, so that it ends by itself
        await idle_connections(url, model, scale, tally, 0.9 * args.attack_seconds)

    return {
        1: (f"12 grammars (enum {scaled(50_000, s)})", grammars),
        2: (f"{scaled(1000, s)} idle connections", idle),
        3: (f"/tokenize {scaled(MB15, s) / 1e6:.1f} MB + {scaled(300_000, s)} msgs", tokenize),
        4: (f"chat n={scaled(128, s)} x 512 top_logprobs 20", big_answer),
        5: (f"{scaled(128, s)} prompts x n=128 x 8", fan_out),
        6: (f"{scaled(500, s)} streams", streams),
    }


async def run_attack(url: str, model: str, number: int, name: str, attack: Attack,
                     args: argparse.Namespace) -> Result:
    result = Result(number, name)
    async with httpx.AsyncClient(timeout=30) as client:
        await settle(client, url, args.settle_seconds)
        result.idle_s = await idle_latency(url, model)
        done = asyncio.Event()
        started = time.monotonic()
        deadline = started + args.attack_seconds

        async def attack_then_stop() -> None:
            try:
                await asyncio.wait_for(attack(url, model, args.scale, result.attack),
                                       args.attack_seconds)
            except asyncio.TimeoutError:
                result.attack["cut-at-cap"] += 1
            finally:
                result.attack_s = time.monotonic() - started
                done.set()

        await asyncio.gather(attack_then_stop(), watch(url, model, result, done, deadline))
        settled = await settle(client, url, args.settle_seconds)
        try:
            result.health_after = str((await client.get(url + "/health")).status_code)
        except httpx.HTTPError as exc:
            result.health_after = label(exc)
        if not settled:
            result.health_after += " (busy)"
        result.kv_after = await metric(client, url, "vllm:kv_cache_usage_perc")
        result.load = os.getloadavg()[0]
    return result


# --- the defects: duplicate request ids, memory after oversized prompts -------------------------

async def duplicate_ids(url: str, model: str, rounds: int) -> collections.Counter:
    """Two concurrent requests with one X-Request-Id per round (one streamed): both 200, or one
    immediate 400; a request unanswered after 20 s counts as hung (three such rounds end it)."""
    outcome: collections.Counter = collections.Counter()
    async with httpx.AsyncClient(timeout=20) as client:
        for r in range(rounds):
            if sum(n for k, n in outcome.items() if "hung" in k) >= 3:
                outcome["rounds-skipped"] = rounds - r
                break
            headers = {"X-Request-Id": f"dup-{r}"}
            plain = {"model": model, **CONTROL}
            tallies = [collections.Counter(), collections.Counter()]
            await asyncio.gather(
                post_with(client, url, plain, headers, tallies[0], stream=False),
                post_with(client, url, plain, headers, tallies[1], stream=True))
            outcome["+".join(str(k) for t in tallies for k in t)] += 1
    return outcome


async def post_with(client: httpx.AsyncClient, url: str, body: dict, headers: dict,
                    tally: collections.Counter, stream: bool) -> None:
    try:
        resp = await client.post(url + "/v1/completions", json={**body, "stream": stream},
                                 headers=headers)
        tally[resp.status_code] += 1
    except httpx.HTTPError as exc:
        tally["hung" if isinstance(exc, httpx.TimeoutException) else label(exc)] += 1


async def oversized_rss(url: str, model: str, pid: int | None, requests: int,
                        seconds: float) -> tuple[float | None, float | None, int, collections.Counter]:
    body = {"model": model, "prompt": "hello world " * (MB15 // 12), "max_tokens": 1}
    statuses: collections.Counter = collections.Counter()
    first = None
    done = 0
    deadline = time.monotonic() + seconds
    async with httpx.AsyncClient(timeout=120) as client:
        while done < requests and time.monotonic() < deadline:
            try:
                statuses[(await client.post(url + "/v1/completions", json=body)).status_code] += 1
            except httpx.HTTPError as exc:
                statuses[label(exc)] += 1
            done += 1
            if done == 1:
                first = rss_mib(pid)
    return first, rss_mib(pid), done, statuses


# --- printing ---------------------------------------------------------------------------------

def print_table(results: list[Result]) -> None:
    """One line per attack; a second one with what the requests got. The ratio is marked
    ``!`` when a control request failed (a fast 503 is no service, however quick)."""
    head = (f"{'#':>2} {'attack':<34} {'idle s':>7} {'med s':>7} {'max s':>7} {'max/idle':>9} "
            f"{'health during':<16} {'after':<10} {'kv after':>8} {'load':>5}")
    print(head)
    print("-" * len(head))
    for r in results:
        med = statistics.median(r.during_s) if r.during_s else float("nan")
        mx = max(r.during_s) if r.during_s else float("nan")
        failed = "!" if set(r.control) - {"200"} else " "
        kv = f"{r.kv_after:.3f}" if r.kv_after is not None else "n/a"
        print(f"{r.number:>2} {r.name:<34} {r.idle_s:7.3f} {med:7.3f} {mx:7.2f} "
              f"{r.ratio:8.1f}{failed} {counts(r.health_during):<16} {r.health_after:<10} "
              f"{kv:>8} {r.load:5.1f}")
        print(f"{'':>3}control got {counts(r.control)}; attack got {counts(r.attack)} "
              f"in {r.attack_s:.0f} s")


# --- the server, when this script starts it -----------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", help="attack this running server (loopback only) instead of one "
                                 "started here")
    p.add_argument("--pid", type=int, help="its process id (RSS, with --url)")
    p.add_argument("--model", help="model to serve (default: the embedded one)")
    p.add_argument("--server-arg", action="append", default=[],
                   help="extra flag for the started server (repeat; e.g. --server-arg=--fair-share"
                        " --server-arg=off)")
    p.add_argument("--scale", type=float, default=1.0, help="multiplies the attacks' counts")
    p.add_argument("--attacks", type=int, nargs="*", default=[1, 2, 3, 4, 5, 6])
    p.add_argument("--attack-seconds", type=float, default=120.0,
                   help="each attack is cut after this (the idle connections last this long)")
    p.add_argument("--settle-seconds", type=float, default=60.0,
                   help="wait at most this for the server to go idle between attacks")
    p.add_argument("--dup-rounds", type=int, default=None, help="default: 100 x scale")
    p.add_argument("--rss-requests", type=int, default=None, help="default: 100 x scale")
    return p.parse_args(argv)


async def main_async(args: argparse.Namespace, url: str, pid: int | None) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        model = (await client.get(url + "/v1/models")).json()["data"][0]["id"]
    await idle_latency(url, model, 3)  # warm-up: first requests pay one-time costs
    catalogue = attacks(args)
    results = []
    for number in args.attacks:
        name, attack = catalogue[number]
        print(f"attack {number}: {name} ...", flush=True)
        results.append(await run_attack(url, model, number, name, attack, args))
    print()
    print_table(results)

    rounds = args.dup_rounds if args.dup_rounds is not None else scaled(100, args.scale)
    if rounds:
        print(f"\nduplicate X-Request-Id, {rounds} rounds (plain+streamed statuses): "
              f"{counts(await duplicate_ids(url, model, rounds))}", flush=True)

    requests = args.rss_requests if args.rss_requests is not None else scaled(100, args.scale)
    if not requests:
        return
    first, last, done, statuses = await oversized_rss(url, model, pid, requests,
                                                      4 * args.attack_seconds)
    if first is None or last is None:
        print(f"15 MB prompts: {done} requests ({counts(statuses)}); RSS n/a (no pid)")
    else:
        print(f"15 MB prompts: {done} requests ({counts(statuses)}); RSS after the first "
              f"{first:.0f} MiB, after {done} {last:.0f} MiB: {last / first:.2f}x")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.url and not ipaddress.ip_address(
            socket.gethostbyname(urlparse(args.url).hostname or "")).is_loopback:
        sys.exit("--url must be a loopback server (this script attacks it)")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # 1,000 idle connections
    proc = None
    try:
        if args.url:
            url, pid = args.url.rstrip("/"), args.pid
        else:
            proc, url, log = start_server(args.model, args.server_arg)
            pid = proc.pid
            print(f"server {url} (pid {pid}, log {log})", flush=True)
        print(json.dumps({k: v for k, v in vars(args).items() if k != "url"}), flush=True)
        asyncio.run(main_async(args, url, pid))
    finally:
        if proc is not None:
            stop_server(proc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
