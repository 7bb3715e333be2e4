"""``hpu-serve buckets`` prints a pooling model's plan when the flags ask for the pooling
runner, as the engine builds it."""

from __future__ import annotations

import ast

import pytest

from server.cli import main
from server.hpu.buckets.pooling import pooling_buckets


def _printed(capsys: pytest.CaptureFixture[str]) -> list[tuple[int, int, int]]:
    line = capsys.readouterr().out.strip()
    assert line.startswith("Generated ") and "pooling buckets" in line, line
    return ast.literal_eval(line.split(": ", 1)[1])


@pytest.mark.parametrize("flags", [["--runner", "pooling"], ["--task", "embed"],
                                   ["--convert", "classify"]])
def test_pooling_plan(capsys: pytest.CaptureFixture[str], flags: list[str]) -> None:
    assert main(["buckets", *flags, "--max-model-len", "512", "--max-num-seqs", "8"]) == 0
    printed = _printed(capsys)
    assert printed == [tuple(b) for b in pooling_buckets(512, 8, 2048)]
    assert (1, 16, 0) in printed and (8, 256, 0) in printed and (8, 512, 0) not in printed


def test_token_budget_bounds_the_plan(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["buckets", "--runner", "pooling", "--max-model-len", "64", "--max-num-seqs",
                 "4", "--max-num-batched-tokens", "128"]) == 0
    assert max(bs * n for bs, n, _ in _printed(capsys)) <= 128


def test_generative_plan_unchanged(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["buckets", "--max-model-len", "256"]) == 0
    assert "pooling" not in capsys.readouterr().out


def test_bad_budget_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit, match="max-num-batched-tokens"):
        main(["buckets", "--runner", "pooling", "--max-model-len", "512",
              "--max-num-batched-tokens", "64"])
