"""Loading an adapter at run time does not stall running streams: the files are read and
checked off the engine thread, and the step that first needs the adapter copies it into a
slot. The read is held open here (a stand-in for a slow disk or a large adapter) while a
stream runs to its end."""

from __future__ import annotations

import asyncio
import threading

import pytest

from server import SamplingParams
from server.config import make_engine_config
from server.engine.async_engine import AsyncEngine
from server.engine.lora import manager
from tests.lora.conftest import hf_greedy, merged

TOKENS = 24


@pytest.mark.slow
def test_a_stream_runs_on_while_an_adapter_is_read(tiny_model, adapter_factory,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    folder, hf_model, _ = tiny_model
    path = adapter_factory(hf_model, 8, seed=21)
    entered, release = threading.Event(), threading.Event()
    read = manager.load_peft_adapter

    def held_read(*args, **kwargs):  # noqa: ANN202 - load_peft_adapter's
        entered.set()
        if not release.wait(120):
            raise RuntimeError("the test never released the read")
        return read(*args, **kwargs)

    monkeypatch.setattr(manager, "load_peft_adapter", held_read)
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    prompt = [5, 6, 7, 8]

    async def tokens_of(stream) -> list[int]:  # noqa: ANN001 - a RequestStream
        return [t async for out in stream for t in out.outputs[0].token_ids]

    async def main() -> tuple[list[int], list[int]]:
        engine = AsyncEngine.from_config(make_engine_config(
            model=folder, dtype="float32", block_size=16, enable_lora=True, max_loras=2,
            max_lora_rank=16))
        engine.start()
        try:
            stream = aiter(await engine.submit("running", prompt, params))
            first = (await anext(stream)).outputs[0].token_ids  # it is decoding now
            load = asyncio.create_task(engine.load_lora_adapter("a", path))
            assert await asyncio.to_thread(entered.wait, 60)
            # the read is held: the stream must still reach its end (an engine thread stuck
            # in the read would produce nothing more)
            rest = await asyncio.wait_for(tokens_of(stream), timeout=60)
            assert not load.done()
            assert len(first) + len(rest) == TOKENS
            release.set()
            adapter = await load
            served = await tokens_of(await engine.submit("adapted", prompt, params,
                                                         lora_request=adapter))
            return list(first) + rest, served
        finally:
            release.set()
            await engine.shutdown()

    base, adapted = asyncio.run(main())
    assert base == hf_greedy(hf_model, prompt, TOKENS)
    assert adapted == hf_greedy(merged(hf_model, path), prompt, TOKENS) != base
