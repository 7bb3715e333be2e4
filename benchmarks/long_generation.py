"""Does the host's work per generated token grow with the output length?

    python benchmarks/long_generation.py [--model PATH] [--tokens 4096]

Generates ``--tokens`` tokens for one request (greedy, ``ignore_eos``) through the OpenAI
serving layer in process, once non-streamed and once streamed, and reports near token 100
and near the end:

- engine host time per step: ``LLMEngine.step()`` minus the model runner's ``execute``
  (scheduling, output processing, detokenization, stop checks, building outputs);
- serving CPU time per output: CPU time of the event-loop thread between two outputs
  reaching the client (accumulating a non-streamed answer, or building an SSE chunk).

Both should be flat: anything proportional to the output length so far makes a long
generation quadratic. With the real model the KV cache grows along the way, and the memory
traffic of a longer attention slows the host code around it a little; so the engine host
time is also measured with the model step replaced by a constant token (host work alone).
Medians over a 100-step window; absolute values vary by machine.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from server.api.protocol import CompletionRequest  # noqa: E402
from server.api.serving import RequestTag, ServingContext  # noqa: E402
from server.api.serving_completion import create_completion  # noqa: E402
from server.config import make_engine_config  # noqa: E402
from server.engine.async_engine import AsyncEngine  # noqa: E402
from server.engine.outputs import ModelRunnerOutput  # noqa: E402
from server.engine.sampling_params import SamplingParams  # noqa: E402
from server.metrics import ServerMetrics  # noqa: E402


def instrument(engine: AsyncEngine) -> list[float]:
    """Records each step's host time (step minus model execution) on the engine thread."""
    core = engine.engine
    host: list[float] = []
    execute, step = core.runner.execute, core.step
    spent = [0.0]

    def timed_execute(batch, token_bitmask=None):  # noqa: ANN001, ANN202
        start = time.perf_counter()
        try:
            return execute(batch, token_bitmask)
        finally:
            spent[0] += time.perf_counter() - start

    def timed_step():  # noqa: ANN202
        spent[0] = 0.0
        start = time.perf_counter()
        outputs = step()
        if outputs:
            host.append(time.perf_counter() - start - spent[0])
        return outputs

    core.runner.execute = timed_execute
    core.step = timed_step
    return host


async def generate(ctx: ServingContext, tokens: int, stream: bool) -> list[float]:
    """CPU time of this (event-loop) thread per output the client receives."""
    request = CompletionRequest(prompt="Once upon a time", max_tokens=tokens, temperature=0,
                                ignore_eos=True, stream=stream)
    per_output: list[float] = []
    last = time.thread_time()
    result = await create_completion(ctx, request, RequestTag(f"long-{stream}"))
    if stream:
        async for _chunk in result:  # type: ignore[union-attr]
            now = time.thread_time()
            per_output.append(now - last)
            last = now
        return per_output
    per_output.append(time.thread_time() - last)
    return per_output


def host_only(engine: AsyncEngine, tokens: int) -> list[float]:
    """Step times of the engine alone: the model step returns a constant token at once."""
    core = engine.engine
    execute = core.runner.execute

    def constant_output(batch, token_bitmask=None):  # noqa: ANN001, ANN202
        return ModelRunnerOutput([65] * len(batch.seqs), [None] * len(batch.seqs))

    core.runner.execute = constant_output
    try:
        core.add_request("host-only", "Once upon a time",
                         SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0))
        times = []
        while core.has_unfinished_requests():
            start = time.perf_counter()
            core.step()
            times.append(time.perf_counter() - start)
        return times
    finally:
        core.runner.execute = execute


def window(values: list[float], center: int, width: int = 100) -> float:
    lo = max(0, min(center - width // 2, len(values) - width))
    return statistics.median(values[lo:lo + width]) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    parser.add_argument("--tokens", type=int, default=4096)
    args = parser.parse_args()
    engine = AsyncEngine.from_config(make_engine_config(model=args.model, max_num_seqs=4,
                                                        max_model_len=args.tokens + 64))
    alone = engine.call(host_only, engine, args.tokens)
    host = instrument(engine)

    async def run() -> dict[bool, tuple[list[float], list[float]]]:
        engine.start()
        core = engine.engine
        ctx = ServingContext(engine, core.model_name, core.limits.max_model_len,
                             ServerMetrics(core.model_name, engine.stats), 0)
        results = {}
        for stream in (False, True):
            host.clear()
            serving = await generate(ctx, args.tokens, stream)
            results[stream] = (list(host), serving)
        await engine.shutdown()
        return results

    results = asyncio.run(run())
    end = args.tokens - 100
    print(f"{args.tokens} tokens, medians over 100-step windows (ms)")
    a0, a1 = window(alone, 100), window(alone, end)
    print(f"engine host time, model step replaced by a constant: @100 {a0:.4f}  @{end} "
          f"{a1:.4f}  ratio {a1 / a0:.2f}")
    print(f"{'mode':<13} {'engine host @100':>17} {f'@{end}':>9} {'ratio':>6} "
          f"{'serving CPU @100':>17} {f'@{end}':>9} {'ratio':>6}")
    for stream, (steps, serving) in results.items():
        e0, e1 = window(steps, 100), window(steps, end)
        line = f"{'streamed' if stream else 'non-streamed':<13} {e0:>17.3f} {e1:>9.3f} " \
               f"{e1 / e0:>6.2f}"
        if stream:
            s0, s1 = window(serving, 100), window(serving, end)
            line += f" {s0:>17.3f} {s1:>9.3f} {s1 / s0:>6.2f}"
        else:
            line += f"   (one response: {serving[0] * 1e3:.1f} ms of serving CPU in all)"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
