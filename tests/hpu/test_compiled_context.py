"""Static shapes with chunked prefill and prefix caching: prompt buckets carry context blocks,
every one is compiled during warmup, and a randomized workload (varied prompt lengths, long
prompts split into chunks, shared prefixes, arrivals while others decode) then runs with zero
compilations and zero bucket misses, token for token as eager execution."""

from __future__ import annotations

import random

import pytest

from server import LLM, SamplingParams
from server.config import ExecutionMode
from server.hpu.types import Phase

pytestmark = pytest.mark.slow  # compile mode end to end

# chunks of up to 32 tokens after up to 7 blocks of context; context-free pairs; decodes
BUCKETS = "(1, [16, 32], [0, 1, 2, 4, 7])\n(2, 16, 0)\n([1, 2, 4], 1, [8, 16, 32])\n"


@pytest.fixture(scope="module")
def engines(tiny_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("buckets") / "buckets.txt"
    path.write_text(BUCKETS)
    common = dict(dtype="float32", block_size=16, max_num_seqs=4, max_model_len=128,
                  max_num_batched_tokens=32, enable_prefix_caching=True,
                  environ={"VLLM_BUCKETING_FROM_FILE": str(path)})
    compiled = LLM(tiny_model[0], execution_mode="compile", **common)
    eager = LLM(tiny_model[0], enforce_eager=True, **common)
    return compiled, eager


def test_context_buckets_warm_then_serve_without_compiling(engines) -> None:
    compiled, eager = engines
    engine = compiled.engine
    counters = engine.counters
    assert engine.runner.graphs.mode is ExecutionMode.COMPILE
    assert engine.limits.chunked_prefill and engine.limits.context_prefill_alone
    planned = engine.runner.shapes.buckets
    assert (1, 32, 7) in planned[Phase.PREFILL]
    assert counters.compilations(stage="warmup") == len(planned[Phase.PREFILL]) + len(
        planned[Phase.DECODE])
    rng = random.Random(1)
    vocab = engine.model_config.vocab_size
    system = [rng.randrange(3, vocab) for _ in range(40)]
    prompts = []
    for i in range(40):
        tail = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 70))]
        prompts.append(system + tail if i % 2 else tail)
    params = [SamplingParams(temperature=rng.choice([0.0, 0.8]), seed=i,
                             max_tokens=rng.randint(1, 20), ignore_eos=True)
              for i in range(40)]
    results_c, results_e = [], []
    start = 0
    for wave in (1, 2, 5, 12, 20):  # new prompts arrive while earlier ones decode
        batch = slice(start, start + wave)
        results_c += compiled.generate(prompts[batch], params[batch])
        results_e += eager.generate(prompts[batch], params[batch])
        start += wave
    assert [r.outputs[0].token_ids for r in results_c] == \
        [r.outputs[0].token_ids for r in results_e]
    assert counters.compilations(stage="serving") == 0
    assert sum(counters._misses.labels(counters.model_name, p)._value.get()
               for p in ("prefill", "decode")) == 0
    stats = engine.stats()
    assert stats.prefix_cache_hits > 0  # cached prefixes ran in context buckets
    assert stats.num_free_blocks == stats.num_blocks
