"""Soak test: minutes of mixed OpenAI traffic against one server, watching for slow leaks.

    python benchmarks/soak.py                          # starts the embedded model, 30 min
    python benchmarks/soak.py --minutes 3 --warmup-minutes 1
    python benchmarks/soak.py --url http://127.0.0.1:8000 --pid 1234

``--concurrency`` clients (32) send chat and completion requests, streamed and not, with
random prompt and output lengths; about ``--disconnect-rate`` (10%) of the streams are
dropped by the client part-way through. Every ``--sample-seconds`` (60) the server's
resident memory (from /proc, so Linux) and ``vllm:kv_cache_usage_perc`` are sampled and
printed. At the end, with the traffic stopped and the server idle again:

- RSS growth from the first sample after ``--warmup-minutes`` (5) to the last one must stay
  below ``--max-rss-growth`` (5%): caches and allocator pools fill during warm-up, a leak
  keeps growing after it;
- KV cache usage must be back to 0 (no block leaked by a finished or aborted request);
- no request may fail (any status but 200, a stream without ``[DONE]``, a transport error
  other than our own disconnects).

Prints the figures (and writes them with ``--result-file``); exits 1 if a bound fails.
Traffic is bounded by ``--minutes`` and stops by itself; point it at your own server only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from local_server import start_server, stop_server

# prompt words: common ones and some multi-byte characters
WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "while", "paged",
         "attention", "keeps", "keys", "and", "values", "in", "blocks", "and", "continuous",
         "batching", "lets", "new", "prompts", "join", "between", "steps", "héllo", "wörld",
         "日本語", "🙂")


@dataclass
class Sample:
    minute: float
    rss_mib: float | None
    kv_usage: float
    running: float
    waiting: float
    requests: int
    errors: int


@dataclass
class Tally:
    requests: int = 0
    completed: int = 0
    disconnects: int = 0
    errors: int = 0
    error_kinds: dict[str, int] = field(default_factory=dict)

    def error(self, kind: str) -> None:
        self.errors += 1
        self.error_kinds[kind] = self.error_kinds.get(kind, 0) + 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default=None, help="a running server; default: start one")
    p.add_argument("--pid", type=int, default=None, help="its process id (RSS, with --url)")
    p.add_argument("--model", default=None, help="model to serve when starting one "
                   "(default: the embedded SmolLM2)")
    p.add_argument("--server-arg", action="append", default=[],
                   help="extra flag for the started server (repeatable), e.g. "
                        "--server-arg=--max-model-len --server-arg=2048")
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--warmup-minutes", type=float, default=5.0)
    p.add_argument("--sample-seconds", type=float, default=60.0)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--disconnect-rate", type=float, default=0.1,
                   help="share of streams the client drops part-way")
    p.add_argument("--max-prompt-words", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-rss-growth", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-file", default=None)
    return p.parse_args(argv)


def rss_mib(pid: int | None) -> float | None:
    if pid is None:
        return None
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return None


async def gauges(client: httpx.AsyncClient) -> dict[str, float]:
    text = (await client.get("/metrics", timeout=30)).text
    wanted = ("vllm:kv_cache_usage_perc", "vllm:num_requests_running",
              "vllm:num_requests_waiting")
    found: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0]
        if name in wanted:
            found[name] = float(line.rsplit(" ", 1)[1])
    return found


def make_request(rng: random.Random, model: str, args: argparse.Namespace
                 ) -> tuple[str, dict]:
    prompt = " ".join(rng.choices(WORDS, k=rng.randint(1, args.max_prompt_words)))
    body: dict = {"model": model, "max_tokens": rng.randint(1, args.max_tokens),
                  "temperature": rng.choice([0.0, 0.7, 1.0]), "stream": rng.random() < 0.5}
    if rng.random() < 0.5:
        return "/v1/chat/completions", {**body, "messages": [{"role": "user",
                                                               "content": prompt}]}
    return "/v1/completions", {**body, "prompt": prompt}


async def one_request(client: httpx.AsyncClient, rng: random.Random, model: str,
                      args: argparse.Namespace, tally: Tally) -> None:
    path, body = make_request(rng, model, args)
    tally.requests += 1
    drop_after = rng.randint(1, 8) if body["stream"] and rng.random() < args.disconnect_rate \
        else None
    try:
        if not body["stream"]:
            resp = await client.post(path, json=body)
            if resp.status_code != 200:
                tally.error(f"status {resp.status_code}")
            else:
                tally.completed += 1
            return
        async with client.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                tally.error(f"status {resp.status_code}")
                return
            events = 0
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    tally.completed += 1
                    return
                if '"error"' in line and json.loads(line[6:]).get("error"):
                    tally.error("error event")
                    return
                events += 1
                if drop_after is not None and events >= drop_after:
                    tally.disconnects += 1  # leaving the block closes the connection
                    return
            tally.error("stream without [DONE]")
    except httpx.HTTPError as exc:
        tally.error(type(exc).__name__)


async def client_loop(base_url: str, model: str, args: argparse.Namespace, seed: int,
                      deadline: float, tally: Tally) -> None:
    rng = random.Random(seed)
    # one connection per client, kept alive between requests as a real client would
    async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:
        while time.monotonic() < deadline:
            await one_request(client, rng, model, args, tally)


async def soak(base_url: str, pid: int | None, args: argparse.Namespace) -> dict:
    tally = Tally()
    samples: list[Sample] = []
    start = time.monotonic()
    deadline = start + args.minutes * 60
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as probe:
        model = (await probe.get("/v1/models")).json()["data"][0]["id"]
        clients = [asyncio.create_task(client_loop(base_url, model, args, args.seed + i,
                                                   deadline, tally))
                   for i in range(args.concurrency)]

        async def sample() -> None:
            g = await gauges(probe)
            s = Sample(minute=round((time.monotonic() - start) / 60, 2), rss_mib=rss_mib(pid),
                       kv_usage=g.get("vllm:kv_cache_usage_perc", -1.0),
                       running=g.get("vllm:num_requests_running", -1.0),
                       waiting=g.get("vllm:num_requests_waiting", -1.0),
                       requests=tally.requests, errors=tally.errors)
            samples.append(s)
            rss = f"{s.rss_mib:.1f} MiB" if s.rss_mib is not None else "n/a"
            print(f"[{s.minute:6.2f} min] rss {rss}  kv {s.kv_usage:.3f}  running "
                  f"{s.running:.0f}  waiting {s.waiting:.0f}  requests {s.requests}  "
                  f"errors {s.errors}  disconnects {tally.disconnects}", flush=True)

        await sample()
        while time.monotonic() < deadline:
            await asyncio.sleep(min(args.sample_seconds, max(0.0, deadline - time.monotonic())))
            await sample()
        await asyncio.gather(*clients)
        idle_deadline = time.monotonic() + 60  # the server finishes what is in flight
        while time.monotonic() < idle_deadline:
            g = await gauges(probe)
            if not g.get("vllm:num_requests_running") and not g.get("vllm:num_requests_waiting"):
                break
            await asyncio.sleep(0.5)
        await sample()  # the final, idle sample
    return report(samples, tally, args)


def report(samples: list[Sample], tally: Tally, args: argparse.Namespace) -> dict:
    after_warmup = [s for s in samples if s.minute >= args.warmup_minutes and s.rss_mib]
    base = after_warmup[0] if after_warmup else None
    last = samples[-1]
    growth = ((last.rss_mib - base.rss_mib) / base.rss_mib
              if base is not None and last.rss_mib else None)
    checks = {
        "rss_growth_below_bound": growth is None or growth < args.max_rss_growth,
        "kv_usage_back_to_0": last.kv_usage == 0.0,
        "no_errors": tally.errors == 0,
    }
    result = {
        "minutes": args.minutes, "concurrency": args.concurrency,
        "requests": tally.requests, "completed": tally.completed,
        "client_disconnects": tally.disconnects, "errors": tally.errors,
        "error_kinds": tally.error_kinds,
        "rss_mib_after_warmup": base.rss_mib if base else None,
        "rss_mib_final": last.rss_mib,
        "rss_growth_after_warmup": growth,
        "kv_cache_usage_final": last.kv_usage,
        "checks": checks, "samples": [asdict(s) for s in samples],
    }
    print(f"requests {tally.requests}, completed {tally.completed}, client disconnects "
          f"{tally.disconnects}, errors {tally.errors} {tally.error_kinds or ''}")
    if growth is None:
        print("RSS growth after warm-up: not measured (no --pid, or the run is shorter than "
              "--warmup-minutes)")
    else:
        print(f"RSS after warm-up {base.rss_mib:.1f} MiB -> final {last.rss_mib:.1f} MiB: "
              f"growth {growth * 100:+.2f}% (bound {args.max_rss_growth * 100:.0f}%)")
    print(f"KV cache usage at the end: {last.kv_usage}")
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'} {name}")
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    proc = None
    if args.url is None:
        proc, url, log = start_server(args.model, args.server_arg, timeout_s=600)
        pid: int | None = proc.pid
        print(f"started {url} (pid {pid}, log {log})", flush=True)
    else:
        url, pid = args.url.rstrip("/"), args.pid
    try:
        result = asyncio.run(soak(url, pid, args))
    finally:
        if proc is not None:
            stop_server(proc)
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(result, indent=2))
    return 0 if all(result["checks"].values()) else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
