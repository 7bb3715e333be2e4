"""Every rank builds its runner through one function: the same limits on rank 0 and on the
workers, rank 0's graph-runner wrapper given at construction."""

from __future__ import annotations

from server.config import make_engine_config
from server.engine.executor.base import build_worker_runner
from server.engine.llm_engine import LLMEngine
from server.engine.worker.builder import build_model_runner
from server.hpu.distributed import SINGLE
from server.hpu.graph_runner import ShapeRunner
from server.hpu.platform import detect_platform
from server.models.loader import load_model, resolve_model_source


def test_rank_0_and_a_worker_resolve_the_same_limits(tiny_model) -> None:
    # compile mode: static shapes, so a prefill with context runs alone on every rank
    config = make_engine_config(model=tiny_model[0], dtype="float32", block_size=16,
                                max_model_len=256, execution_mode="compile")
    engine = LLMEngine(config)
    worker = build_worker_runner(config, detect_platform("cpu"), SINGLE)
    assert engine.limits.context_prefill_alone
    assert worker.limits == engine.limits == engine.runner.limits
    assert worker.limits.max_num_batched_tokens == 512  # the CPU platform's default


def test_the_graph_runner_wrapper_is_given_at_construction(tiny_model) -> None:
    config = make_engine_config(model=tiny_model[0], dtype="float32", block_size=16,
                                max_model_len=256)
    platform = detect_platform("cpu")
    source = resolve_model_source(config.model.model)
    loaded = load_model(source, config.model.dtype, platform.device)
    wrapped: list[ShapeRunner] = []

    def wrap(inner: ShapeRunner) -> ShapeRunner:
        wrapped.append(inner)
        return inner

    runner = build_model_runner(config, platform, source, loaded, wrap_graphs=wrap)
    assert wrapped == [runner.graphs]
