"""The async engine: streams, aborts, and an event loop that never blocks on the model."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from server import SamplingParams
from server.config import make_engine_config
from server.engine.async_engine import AsyncEngine
from server.engine.errors import RequestError
from server.engine.inputs import PromptInput


@pytest.fixture(scope="module")
def engine_config(tiny_model):
    return make_engine_config(model=tiny_model[0], dtype="float32", block_size=16)


def test_streams_abort_and_loop_stays_responsive(engine_config) -> None:
    async def main() -> None:
        engine = AsyncEngine.from_config(engine_config)
        step = engine.engine.step

        def slow_step():  # noqa: ANN202 - stands in for a real model's compute time
            time.sleep(0.01)  # releases the GIL like torch kernels do
            return step()

        engine.engine.step = slow_step
        engine.start()
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)

        ticks = 0
        longest_gap = 0.0

        async def ticker() -> None:
            nonlocal ticks, longest_gap
            last = time.monotonic()
            while True:
                await asyncio.sleep(0.005)
                now = time.monotonic()
                longest_gap = max(longest_gap, now - last)
                last = now
                ticks += 1

        tick_task = asyncio.create_task(ticker())

        async def collect(request_id: str) -> tuple[list[int], str, str]:
            stream = await engine.submit(request_id, "the quick brown fox", params)
            tokens: list[int] = []
            text = ""
            reason = ""
            async for out in stream:
                tokens += out.outputs[0].token_ids
                text += out.outputs[0].text
                reason = out.outputs[0].finish_reason or ""
            return tokens, text, reason

        started = time.monotonic()
        results = await asyncio.gather(*(collect(f"r{i}") for i in range(6)))
        elapsed = time.monotonic() - started
        for tokens, text, reason in results:
            assert tokens == results[0][0]
            assert len(tokens) == 40
            assert reason == "length"
            assert text == engine.tokenizer.decode(tokens)

        # leaving a stream early aborts the request and frees its blocks
        stream = await engine.submit("early", "the quick brown fox",
                                     SamplingParams(max_tokens=200, ignore_eos=True))
        async for out in stream:
            if out.num_generated_tokens >= 3:
                break
        for _ in range(200):
            stats = engine.stats()
            if stats.num_running == 0 and stats.num_free_blocks == stats.num_blocks:
                break
            await asyncio.sleep(0.01)
        stats = engine.stats()
        assert stats.num_running == 0
        assert stats.num_free_blocks == stats.num_blocks

        with pytest.raises(RequestError):
            await engine.submit("bad", [], params)
        tick_task.cancel()
        # the event loop kept running while the model computed
        assert elapsed > 0.4  # 40+ steps of 10 ms
        assert ticks > elapsed / 0.005 / 4
        assert longest_gap < 0.1
        assert engine.is_alive
        await engine.shutdown()

    asyncio.run(main())


def test_load_warmup_and_steps_run_on_one_engine_thread(engine_config) -> None:
    # One thread per process calls into torch: a second OpenMP team slowed decode ~1.5x.
    from server.engine.llm_engine import LLMEngine

    threads: list[int] = []

    def factory(on_fault: Callable[[BaseException], None]) -> LLMEngine:
        threads.append(threading.get_ident())
        return LLMEngine(engine_config, on_fault)

    engine = AsyncEngine(factory)
    engine.call(lambda: threads.append(threading.get_ident()))  # how the CLI runs warmup
    step = engine.engine.step

    def recording_step():  # noqa: ANN202
        threads.append(threading.get_ident())
        return step()

    engine.engine.step = recording_step

    async def main() -> str:
        engine.start()
        stream = await engine.submit("r", [1, 2, 3], SamplingParams(max_tokens=4,
                                                                     ignore_eos=True))
        text = [out async for out in stream]
        await engine.shutdown()
        return [t for out in text for t in out.outputs[0].token_ids]

    assert len(asyncio.run(main())) == 4
    assert len(threads) >= 6
    assert set(threads) == {threads[0]}
    assert threads[0] != threading.get_ident()


def test_submitted_requests_count_as_waiting_before_the_engine_sees_them(engine_config) -> None:
    # The API's --max-waiting-requests check reads stats() the moment a request arrives;
    # a burst landing between two engine steps must not all look like an empty queue.
    engine = AsyncEngine.from_config(engine_config)
    gate = threading.Event()

    async def main() -> tuple[int, int, int]:
        engine.start()
        busy = threading.Thread(target=engine.call, args=(gate.wait,))
        busy.start()  # the engine thread is occupied: commands queue up behind it
        params = SamplingParams(max_tokens=3, ignore_eos=True)
        streams = [await engine.submit(f"r{i}", [1, 2, 3], params) for i in range(3)]
        queued = engine.stats().num_waiting
        with pytest.raises(RequestError):
            await engine.submit("bad", [], params)  # refused in prepare: not counted
        after_refusal = engine.stats().num_waiting
        gate.set()
        busy.join()
        for stream in streams:
            assert [out async for out in stream][-1].num_generated_tokens == 3
        drained = engine.stats().num_waiting
        await engine.shutdown()
        return queued, after_refusal, drained

    assert asyncio.run(main()) == (3, 3, 0)


def test_a_prompt_builder_runs_with_the_checks_in_one_offloaded_job(engine_config) -> None:
    # The API hands a builder (a chat template to render) and its preprocess pool: building,
    # tokenizing and validating cross to a thread once, through that pool.
    engine = AsyncEngine.from_config(engine_config)
    jobs: list[str] = []

    async def offload(fn: Callable[[], Any]) -> Any:  # counts, in place of the pool
        jobs.append(fn.__name__)
        return await asyncio.to_thread(fn)

    def build() -> PromptInput:
        assert threading.current_thread() is not threading.main_thread()
        return PromptInput("the quick brown fox", SamplingParams(max_tokens=3, ignore_eos=True))

    async def main() -> int:
        engine.start()
        stream = await engine.submit("r", build, client="c", offload=offload)
        outs = [out async for out in stream]
        with pytest.raises(TypeError, match="its own params"):
            await engine.submit("r2", build, SamplingParams(), offload=offload)
        await engine.shutdown()
        return outs[-1].num_generated_tokens

    assert asyncio.run(main()) == 3
    assert len(jobs) == 1


def test_an_id_is_claimed_before_its_prompt_is_built(engine_config) -> None:
    # A second request with the same id is refused at once (never hangs, never replaces the
    # stream) while the first is still being built; a cancelled build frees its id.
    engine = AsyncEngine.from_config(engine_config)
    building = threading.Event()
    release = threading.Event()
    params = SamplingParams(max_tokens=2, ignore_eos=True)

    def slow_build() -> PromptInput:
        building.set()
        release.wait(10)
        return PromptInput([1, 2, 3], params)

    async def main() -> tuple[int, int, int]:
        engine.start()
        first = asyncio.create_task(engine.submit("same", slow_build))
        await asyncio.to_thread(building.wait, 10)
        with pytest.raises(RequestError, match="already in use"):
            await asyncio.wait_for(engine.submit("same", [1, 2, 3], params), 2)
        release.set()
        tokens = [out async for out in await first][-1].num_generated_tokens

        building.clear()
        release.clear()
        gone = asyncio.create_task(engine.submit("left", slow_build))
        await asyncio.to_thread(building.wait, 10)
        gone.cancel()  # the client went away while its prompt was being built
        with pytest.raises(asyncio.CancelledError):
            await gone
        release.set()
        in_transit = engine.stats().num_waiting
        again = [out async for out in await engine.submit("left", [1, 2, 3], params)]
        await engine.shutdown()
        return tokens, in_transit, again[-1].num_generated_tokens

    assert asyncio.run(main()) == (2, 0, 2)
