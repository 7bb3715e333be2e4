"""--bucketing-strategy adaptive on CPU compiled graphs: buckets are added while serving
where traffic pads a lot, warmed between steps and counted as warmup, never as serving."""

from __future__ import annotations

import random

import pytest

from server import LLM, SamplingParams
from server.config import make_engine_config
from server.hpu.types import Phase

# deliberately coarse: every prompt pads to 64 tokens, every decode to 4 rows x 32 blocks
BUCKETS = "(1, 64, 0)\n(4, 1, 32)\n"


def test_off_by_default_and_selected_by_flag_or_env() -> None:
    assert not make_engine_config().bucketing.adaptive
    cfg = make_engine_config(bucketing_strategy="adaptive").bucketing
    assert cfg.adaptive and cfg.strategy == "exp"
    assert make_engine_config({"VLLM_BUCKETING_STRATEGY": "adaptive"}).bucketing.adaptive


@pytest.mark.slow  # compile mode while serving (9 s): make test-fast skips it
def test_buckets_added_while_serving_compile_as_warmup(tiny_model, tmp_path) -> None:
    path = tmp_path / "buckets.txt"
    path.write_text(BUCKETS)
    env = {"VLLM_BUCKETING_FROM_FILE": str(path), "HPU_SERVE_ADAPTIVE_INTERVAL": "8",
           "HPU_SERVE_ADAPTIVE_MAX_ADDED": "3"}
    llm = LLM(tiny_model[0], execution_mode="compile", dtype="float32", block_size=16,
              max_num_seqs=4, max_model_len=64, bucketing_strategy="adaptive", environ=env)
    counters = llm.engine.counters
    warmed = counters.compilations(stage="warmup")
    assert warmed == 2
    rng = random.Random(5)
    vocab = llm.engine.model_config.vocab_size
    for wave in (1, 2, 1, 3):
        prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(4, 12))]
                   for _ in range(wave)]
        llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
                               for _ in range(wave)])
    added = llm.engine.runner.adaptive.added_count
    assert 1 <= added <= 3
    assert counters.compilations(stage="serving") == 0
    assert counters.compilations(stage="warmup") == warmed + added
    plan = llm.engine.runner.shapes.buckets
    assert len(plan[Phase.PREFILL]) + len(plan[Phase.DECODE]) == 2 + added
    # what was added is tighter than the coarse buckets the traffic padded to
    new = [b for p in Phase for b in plan[p] if b not in ((1, 64, 0), (4, 1, 32))]
    assert all(b[0] * b[1] < 64 or b[0] * max(b[2], 1) < 4 * 32 for b in new)
    total = sum(counters._added.labels(counters.model_name, p)._value.get()
                for p in ("prefill", "decode"))
    assert total == added
    # the dump shows the plan as it is now, added buckets included
    snap = counters.observed.snapshot()
    assert sum(len(v) for v in snap["plan"].values()) == 2 + added
