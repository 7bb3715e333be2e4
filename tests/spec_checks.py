"""What the speculative-decoding tests of every method share: the engine they build, greedy
outputs, the leak check, and the compile-mode workload with its zero-compilation check."""

from __future__ import annotations

import torch

from server import LLM, SamplingParams
from server.hpu.types import Stage


def spec_llm(folder: str, config: dict | None, kernels: bool | None = None, **extra) -> LLM:
    """An fp32 engine, speculating with ``config`` (None: plain decoding); ``kernels`` pins
    the CPU layer ops (fused kernels or PyTorch ops), None leaves the platform's choice."""
    kw: dict = {"speculative_config": config} if config else {}
    if kernels is not None:
        kw["environ"] = {"HPU_SERVE_CPU_KERNELS": "1" if kernels else "0"}
    return LLM(folder, **{"dtype": "float32", "block_size": 16, "max_num_seqs": 8, **kw,
                          **extra})


def outputs(engine: LLM, batch: list[list[int]], **fields) -> list[list[list[int]]]:
    """Each prompt's completions' token ids, greedy and 40 tokens unless ``fields`` say."""
    params = SamplingParams(**{"temperature": 0.0, "max_tokens": 40, "ignore_eos": True,
                               **fields})
    return [[c.token_ids for c in o.outputs] for o in engine.generate(batch, params)]


def all_free(engine: LLM) -> bool:
    """Every KV block back in the pool and nothing left running: no leak."""
    stats = engine.engine.stats()
    return (stats.num_free_blocks == stats.num_blocks
            and not engine.engine.has_unfinished_requests())


def draft_warmed_every_bucket(engine: LLM) -> dict:
    """The draft's graphs were compiled for every planned bucket, as the target's were,
    before serving; returns the plan ({phase: buckets})."""
    runner = engine.engine.runner
    assert runner.draft is not None
    planned = {phase: set(b) for phase, b in runner.shapes.buckets.items()}
    assert runner.draft.graphs.warmed == runner.graphs.warmed == planned
    return planned


def serves_without_compiling(engine: LLM, pool: list[list[int]], max_prompt: int,
                             max_tokens: int, rows: int = 4, growth: int = 5) -> None:
    """Three rounds of ``rows`` prompts of random lengths (1 to ``max_prompt``) cut from
    ``pool``, each round ``growth`` tokens longer, then: drafts were made, and serving
    compiled nothing and missed no bucket."""
    gen = torch.Generator().manual_seed(5)
    for i in range(3):
        lengths = torch.randint(1, max_prompt, (rows,), generator=gen).tolist()
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens + i * growth,
                                ignore_eos=True)
        engine.generate([pool[(i + j) % len(pool)][:n] for j, n in enumerate(lengths)],
                        params)
    assert engine.engine.stats().spec_num_draft_tokens > 0
    counters = engine.engine.counters
    assert counters.compilations(stage=Stage.SERVING) == 0
    missed = sum(s.value for f in counters.registry.collect() if f.name.endswith("misses")
                 for s in f.samples if s.name.endswith("_total"))
    assert missed == 0
