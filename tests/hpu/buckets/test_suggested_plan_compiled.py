"""The operator's loop on CPU compiled graphs: record shapes, fit a plan, serve the same
traffic compiled with it: warmup compiles each bucket once, serving compiles nothing. Also:
shapes an eager engine records with chunking and caching on still fit a plan the compiled
server accepts whole."""

from __future__ import annotations

import random

import pytest

from server import LLM, SamplingParams
from server.hpu.buckets.fit import Observed, WarmupModel, evaluate, format_bucket_file, suggest
from server.hpu.types import Phase

pytestmark = pytest.mark.slow  # compile mode end to end

# without chunked prefill and prefix caching an eager engine schedules as graphs do (no
# prefill after a context, no decodes riding in a prompt batch), so its shapes are the ones
# a compiled server meets: the cheap way to record them here
COMMON = dict(dtype="float32", block_size=16, max_num_seqs=4, max_model_len=128,
              enable_chunked_prefill=False, enable_prefix_caching=False)


def traffic(llm: LLM, vocab: int) -> None:
    rng = random.Random(7)
    for wave in (1, 3, 4, 6):
        prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(1, 60))]
                   for _ in range(wave)]
        params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 24), ignore_eos=True)
                  for _ in range(wave)]
        llm.generate(prompts, params)


def test_suggested_plan_serves_with_zero_compilations(tiny_model, tmp_path) -> None:
    eager = LLM(tiny_model[0], enforce_eager=True, **COMMON)
    vocab = eager.engine.model_config.vocab_size
    traffic(eager, vocab)
    obs = Observed.from_json(eager.engine.counters.observed.snapshot())
    assert obs.plan is None and obs.shapes[Phase.DECODE]
    plan = suggest(obs, max_buckets=10)
    path = tmp_path / "buckets.txt"
    path.write_text(format_bucket_file(plan))
    compiled = LLM(tiny_model[0], execution_mode="compile",
                   environ={"VLLM_BUCKETING_FROM_FILE": str(path)}, **COMMON)
    counters = compiled.engine.counters
    planned = compiled.engine.runner.shapes.buckets
    assert {p: sorted(planned[p]) for p in Phase} == {p: sorted(plan[p]) for p in Phase}
    assert counters.compilations(stage="warmup") == sum(len(b) for b in plan.values())
    # warmup measured each bucket's cost (the next --suggest's warmup budget)
    for phase in Phase:
        assert sorted(counters.observed.warmup_seconds(phase)) == sorted(plan[phase])
    traffic(compiled, vocab)
    assert counters.compilations(stage="serving") == 0
    assert sum(counters._misses.labels(counters.model_name, p)._value.get()
               for p in ("prefill", "decode")) == 0


def test_an_eager_trace_with_context_prefills_fits_a_valid_plan(tiny_model) -> None:
    """Eager steps batch prefills after a context (and carry decodes with them); graphs run
    each alone. The fit counts such a batch as that many single prefills, so every bucket it
    writes is one the server loads (a prompt bucket with context has batch size 1)."""
    eager = LLM(tiny_model[0], enforce_eager=True, dtype="float32", block_size=16,
                max_num_seqs=4, max_model_len=128, max_num_batched_tokens=48)
    traffic(eager, eager.engine.model_config.vocab_size)
    doc = eager.engine.counters.observed.snapshot()
    assert doc["static_shapes"] is False
    assert any(s[0] > 1 and s[2] > 0 for s in doc["phases"]["prefill"]["shapes"])
    obs = Observed.from_json(doc)
    assert all(bs == 1 for bs, _, ctx in obs.shapes[Phase.PREFILL] if ctx)
    plan = suggest(obs, max_buckets=16)
    assert all(bs == 1 for bs, _, ctx in plan[Phase.PREFILL] if ctx)
    assert sum(evaluate(obs, plan, WarmupModel({})).misses.values()) == 0
