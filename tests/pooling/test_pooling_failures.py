"""A pooling batch that raises is retried request by request: a fault tied to one request
ends that request only; steps that save no request stop the engine after a few in a row."""

from __future__ import annotations

import pytest

from server.engine.errors import EngineFaultError
from server.engine.failures import MAX_FAILED_STEPS
from server.engine.llm import LLM

POISON = 7  # a token id the broken runner refuses
TEXTS = [[5, 9, 11, 12], [5, POISON, 11], [13, 14, 15, 16, 17]]


@pytest.fixture(scope="module")
def engine(st_folder):
    return LLM(st_folder("bert", "mean", True), dtype="float32", max_num_seqs=4).engine


def _run_all(engine, ids: list[str]) -> dict:
    outputs = {}
    for _ in range(20):
        for out in engine.step():
            outputs[out.request_id] = out
        if not engine.has_unfinished_requests():
            break
    assert sorted(outputs) == sorted(ids)
    return outputs


def test_a_poisoned_request_fails_alone(engine, monkeypatch) -> None:
    for i, ids in enumerate(TEXTS):
        engine.add_request(f"solo-{i}", ids)
    solo = _run_all(engine, [f"solo-{i}" for i in range(len(TEXTS))])

    execute = engine.runner.execute

    def broken(rows):
        if any(POISON in row.token_ids for row in rows):
            raise RuntimeError("poisoned row")
        return execute(rows)

    monkeypatch.setattr(engine.runner, "execute", broken)
    for i, ids in enumerate(TEXTS):  # one batch of three: the whole batch raises first
        engine.add_request(f"mix-{i}", ids)
    mixed = _run_all(engine, [f"mix-{i}" for i in range(len(TEXTS))])
    assert "poisoned row" in mixed["mix-1"].error
    for i in (0, 2):
        assert mixed[f"mix-{i}"].error is None
        assert mixed[f"mix-{i}"].data == solo[f"solo-{i}"].data  # each ran alone, as solo
    assert engine.failed_steps.count == 0  # two of three were saved: not a device fault


def test_steps_that_save_no_request_stop_the_engine(engine, monkeypatch) -> None:
    def dead(rows):
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.runner, "execute", dead)
    for step in range(MAX_FAILED_STEPS):
        engine.add_request(f"dead-{step}", TEXTS[0])
        if step < MAX_FAILED_STEPS - 1:
            (out,) = engine.step()
            assert "device lost" in out.error
    with pytest.raises(EngineFaultError, match="3 pooling steps in a row"):
        engine.step()
