"""CPU compiled graphs: after warmup, a randomized workload inside the bucket bounds causes
zero compilations (as torch counts them) and matches eager execution token for token."""

from __future__ import annotations

import logging
import random

import pytest

from server import LLM, SamplingParams
from server.config import ExecutionMode

BUCKETS = "# prompt buckets\n(1, [32, 64], 0)\n# decode buckets\n([1, 4], 1, [8, 32])\n"


@pytest.fixture(scope="module")
def engines(tiny_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("buckets") / "buckets.txt"
    path.write_text(BUCKETS)
    env = {"VLLM_BUCKETING_FROM_FILE": str(path)}
    common = dict(dtype="float32", block_size=16, max_num_seqs=4, max_model_len=128,
                  environ=env)
    compiled = LLM(tiny_model[0], execution_mode="compile", **common)
    eager = LLM(tiny_model[0], enforce_eager=True, **common)
    return compiled, eager


@pytest.mark.slow  # a mixed workload in compile mode against eager (19 s): make test-fast skips it
def test_zero_compilations_after_warmup_and_eager_parity(engines) -> None:
    compiled, eager = engines
    counters = compiled.engine.counters
    assert compiled.engine.runner.graphs.mode is ExecutionMode.COMPILE
    # every planned bucket was compiled exactly once during warmup (layers share one graph)
    planned = compiled.engine.runner.shapes.buckets
    assert counters.compilations(stage="warmup") == len(planned["prefill"]) + len(planned["decode"])
    assert counters.compilations(stage="serving") == 0
    rng = random.Random(0)
    vocab = compiled.engine.model_config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(1, 64))] for _ in range(200)]
    params = [SamplingParams(temperature=rng.choice([0.0, 0.8]), seed=i, top_k=rng.choice([-1, 20]),
                             max_tokens=rng.randint(1, 60), ignore_eos=True)
              for i in range(200)]
    # varied concurrency: waves of different sizes
    results_c, results_e = [], []
    start = 0
    for wave in (1, 3, 4, 17, 50, 125):
        chunk = slice(start, start + wave)
        results_c += compiled.generate(prompts[chunk], params[chunk])
        results_e += eager.generate(prompts[chunk], params[chunk])
        start += wave
    assert start == 200
    assert counters.compilations(stage="serving") == 0
    assert [r.outputs[0].token_ids for r in results_c] == [r.outputs[0].token_ids for r in results_e]
    assert sum(compiled.engine.counters._misses.labels(counters.model_name, p)._value.get()
               for p in ("prefill", "decode")) == 0


def test_guided_and_unguided_requests_mixed_cause_no_compilation(engines) -> None:
    """Grammar masks enter the sampler as a fixed-shape bitmask: a randomized mix of guided
    and unguided requests replays the warmed-up shapes; unguided rows equal eager's."""
    from server.engine.sampling_params import StructuredOutputsParams as Spec

    compiled, eager = engines
    counters = compiled.engine.counters
    rng = random.Random(1)
    vocab = compiled.engine.model_config.vocab_size
    specs = [Spec(regex=r"[0-9]{2,6}"), Spec(choice=["alpha", "beta", "gamma"]),
             Spec(json={"type": "object", "properties": {"k": {"enum": [1, 2, 3]}},
                        "required": ["k"], "additionalProperties": False})]
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(1, 64))] for _ in range(60)]
    params = [SamplingParams(temperature=rng.choice([0.0, 1.0]), seed=i, max_tokens=30,
                             structured_outputs=rng.choice(specs) if i % 2 else None,
                             ignore_eos=not i % 2)
              for i in range(60)]
    start = 0
    for wave in (1, 4, 15, 40):
        chunk = slice(start, start + wave)
        results = compiled.generate(prompts[chunk], params[chunk])
        reference = eager.generate(prompts[chunk], params[chunk])
        for p, got, want in zip(params[chunk], results, reference):
            if p.structured_outputs is None:
                assert got.outputs[0].token_ids == want.outputs[0].token_ids
            else:
                assert got.outputs[0].finish_reason == "stop", got.outputs[0].text
        start += wave
    assert counters.compilations(stage="serving") == 0


def test_batch_beyond_buckets_is_counted_and_correct(engines) -> None:
    compiled, eager = engines
    counters = compiled.engine.counters
    misses = counters._misses.labels(counters.model_name, "prefill")
    before = misses._value.get()
    prompt = list(range(5, 105))  # 100 tokens: beyond the largest prompt bucket (64)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    out_c = compiled.generate([prompt], params)[0].outputs[0].token_ids
    out_e = eager.generate([prompt], params)[0].outputs[0].token_ids
    assert out_c == out_e
    assert len(out_c) == 4
    assert misses._value.get() > before
    assert counters.compilations(stage="serving") > 0  # the unplanned shape compiled


def test_warmup_log_lines_and_skip_warmup(tiny_model, tmp_path, caplog) -> None:
    path = tmp_path / "one.txt"
    path.write_text("(1, 32, 0)\n(2, 1, 8)\n")
    common = dict(dtype="float32", block_size=16, max_num_seqs=2, max_model_len=64,
                  execution_mode="compile")
    server_logger = logging.getLogger("server")  # it does not propagate to the root
    server_logger.addHandler(caplog.handler)
    try:
        with caplog.at_level("INFO", logger="server"):
            warmed = LLM(tiny_model[0], environ={"VLLM_BUCKETING_FROM_FILE": str(path)},
                         **common)
    finally:
        server_logger.removeHandler(caplog.handler)
    text = caplog.text
    assert "Generated 1 prompt buckets [bs, query, num_blocks]: [(1, 32, 0)]" in text
    assert "[Warmup][Prompt][1/1] batch_size:1 seq_len:32 free_mem:" in text
    assert "[Warmup][Decode][1/1] batch_size:2 seq_len:8 free_mem:" in text
    assert "Warming up sampler with batch sizes: [1, 2] and following configs:" in text
    assert len({m for m in caplog.messages if "batch_changed=" in m}) == 12
    assert "Warmup finished in" in text
    assert warmed.engine.counters.compilations(stage="warmup") == 2

    skipped = LLM(tiny_model[0], environ={"VLLM_BUCKETING_FROM_FILE": str(path),
                                          "VLLM_SKIP_WARMUP": "true"}, **common)
    assert skipped.engine.counters.compilations() == 0
    skipped.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))
    # without warmup the shapes compile on first use, and the counters say so
    assert skipped.engine.counters.compilations(stage="serving") == 2
