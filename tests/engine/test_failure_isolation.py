"""A fault tied to one request ends that request only; a fault in every step stops the engine.

Faults are injected where real ones would arise: the model runner (inputs, sampling setup)
and the output processing (detokenization) of one request.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from server import SamplingParams
from server.config import make_engine_config
from server.engine.async_engine import AsyncEngine
from server.engine.errors import EngineDeadError, EngineFaultError, RequestFailedError
from server.engine.llm_engine import LLMEngine

POISON = 7  # a prompt holding this token id makes the injected fault fire
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_model) -> LLMEngine:
    return LLMEngine(make_engine_config(model=tiny_model[0], dtype="float32", block_size=16,
                                        max_num_seqs=8))


def run_all(engine: LLMEngine, prompts: dict[str, list[int]], max_steps: int = 10**6) -> dict:
    """Each request's whole output, stepping until none is left (or ``max_steps``)."""
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, PARAMS)
    results: dict = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.request_id in results:
                results[out.request_id].add(out)
            else:
                results[out.request_id] = out
    assert all(out.finished for out in results.values())
    return results


def poison_runner(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    execute = engine.runner.execute

    def faulty(batch, token_bitmask=None):  # noqa: ANN001, ANN202
        if any(POISON in s.prompt_token_ids for s in batch.seqs):
            raise OverflowError("int too big to convert")  # e.g. a value the native code refuses
        return execute(batch, token_bitmask)

    monkeypatch.setattr(engine.runner, "execute", faulty)


PROMPTS = {"a": [3, 4, 5, 6], "bad": [3, POISON, 5], "b": [8, 9, 10, 11, 12]}


def only_bad_failed(engine: LLMEngine, finals: dict, solo: dict, error: str) -> None:
    """"bad" ended with ``error``; "a" and "b" gave their solo tokens; no KV block leaked."""
    assert error in finals["bad"].error
    assert finals["bad"].outputs[0].finish_reason == "abort"
    for rid in ("a", "b"):
        assert finals[rid].error is None
        assert finals[rid].outputs[0].token_ids == solo[rid]
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_blocks, "the failed request leaked KV blocks"


def test_runner_fault_ends_only_its_request(engine: LLMEngine, monkeypatch) -> None:
    solo = {rid: run_all(engine, {rid: p})[rid].outputs[0].token_ids
            for rid, p in PROMPTS.items() if rid != "bad"}
    poison_runner(engine, monkeypatch)
    finals = run_all(engine, PROMPTS)
    assert finals["bad"].error is not None
    only_bad_failed(engine, finals, solo, "OverflowError")
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting) == (0, 0)


def test_output_processing_fault_ends_only_its_request(engine: LLMEngine, monkeypatch) -> None:
    engine.add_request("x", [3, 4, 5], PARAMS)
    engine.add_request("y", [3, 4, 6], PARAMS)

    def broken(ids):  # noqa: ANN001, ANN202
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")

    monkeypatch.setattr(engine.output_processor.requests["y"].detokenizers[0], "update", broken)
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert finals["y"].error is not None
    assert "UnicodeDecodeError" in finals["y"].error
    assert finals["x"].error is None
    assert finals["x"].num_generated_tokens == 8
    assert engine.stats().num_free_blocks == engine.stats().num_blocks


def test_a_request_the_scheduler_cannot_place_fails_instead_of_spinning(
        engine: LLMEngine, monkeypatch) -> None:
    """A scheduling bug (here: a plan that never fits one prompt) leaves that request
    waiting with nothing running to free room. The engine ends it with the scheduler's
    state in the error, and the requests behind it run, within a bounded number of steps."""
    solo = {rid: run_all(engine, {rid: p})[rid].outputs[0].token_ids
            for rid, p in PROMPTS.items() if rid != "bad"}
    plan = engine.scheduler.block_manager.plan

    def never_fits(seq):  # noqa: ANN001, ANN202
        found = plan(seq)
        return dataclasses.replace(found, fits=False) if POISON in seq.prompt_token_ids else found

    monkeypatch.setattr(engine.scheduler.block_manager, "plan", never_fits)
    # "b" queues behind "bad"; without the guard the engine spins, placing nothing
    finals = run_all(engine, PROMPTS, max_steps=100)
    assert not engine.has_unfinished_requests(), f"still waiting: {engine.stats()}"
    only_bad_failed(engine, finals, solo, "could not place it")


def test_steps_failing_for_everyone_are_an_engine_fault(engine: LLMEngine, monkeypatch) -> None:
    def device_lost(batch, token_bitmask=None):  # noqa: ANN001, ANN202
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.runner, "execute", device_lost)
    for i in range(2):  # each lone request fails on its own; not yet conclusive
        engine.add_request(f"lone{i}", [3, 4, 5], PARAMS)
        failed = engine.step()
        assert [o.error for o in failed] == ["RuntimeError: device lost"]
    engine.add_request("third", [3, 4, 5], PARAMS)
    with pytest.raises(EngineFaultError, match="device lost"):
        engine.step()


def test_async_engine_reports_request_failure_and_death(tiny_model, monkeypatch) -> None:
    died: list[BaseException] = []
    engine = AsyncEngine.from_config(make_engine_config(model=tiny_model[0], dtype="float32",
                                                        block_size=16), on_dead=died.append)
    poison_runner(engine.engine, monkeypatch)

    async def collect(request_id: str, prompt: list[int]) -> list[int] | BaseException:
        try:
            stream = await engine.submit(request_id, prompt, PARAMS)
            return [t for out in [o async for o in stream] for t in out.outputs[0].token_ids]
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            return exc

    async def main() -> tuple:
        engine.start()
        results = await asyncio.gather(*(collect(r, p) for r, p in PROMPTS.items()))
        alive_after_one_failure = engine.is_alive

        def device_lost(batch, token_bitmask=None):  # noqa: ANN001, ANN202
            raise RuntimeError("device lost")

        monkeypatch.setattr(engine.engine.runner, "execute", device_lost)
        later = [await collect(f"late{i}", [3, 4, 5]) for i in range(4)]
        await engine.shutdown()
        return results, alive_after_one_failure, later

    (good_a, bad, good_b), alive, later = asyncio.run(main())
    assert isinstance(bad, RequestFailedError)
    assert "bad" in str(bad)
    assert len(good_a) == 8
    assert len(good_b) == 8
    assert alive
    assert [type(e) for e in later[:2]] == [RequestFailedError, RequestFailedError]
    assert isinstance(later[2], EngineDeadError)
    assert isinstance(later[3], EngineDeadError)
    assert len(died) == 1
    assert isinstance(died[0], EngineFaultError)
    assert not engine.is_alive
