"""Which engine core serves a configuration: ``--runner`` resolved against the checkpoint
(vLLM's auto choice: sentence-transformers folders, encoders and ``*ForSequenceClassification``
pool, everything else generates)."""

from __future__ import annotations

from server.config import EngineConfig, Runner
from server.engine.executor import FaultListener
from server.engine.llm_engine import LLMEngine
from server.engine.pooling.engine import PoolingEngine
from server.models.encoders.load import checkpoint_pools
from server.models.hub import with_local_model
from server.models.loader import resolve_model_source


def resolve_runner(config: EngineConfig) -> Runner:
    runner = config.pooling.runner
    if runner is not Runner.AUTO:
        return runner
    source = resolve_model_source(config.model.model)
    if source.is_gguf:
        return Runner.GENERATE
    return (Runner.POOLING if checkpoint_pools(source.folder, config.pooling.overrides)
            else Runner.GENERATE)


def build_engine(config: EngineConfig,
                 on_fault: FaultListener | None = None) -> LLMEngine | PoolingEngine:
    """The engine core ``--runner`` asks for (resolved from the checkpoint when auto). A Hub
    id is resolved to its cached copy first: the checkpoint decides the runner."""
    config = with_local_model(config)
    if resolve_runner(config) is Runner.POOLING:
        return PoolingEngine(config, on_fault)
    if config.pooling.hf_overrides:
        raise ValueError("--hf-overrides is supported with --runner pooling only (the "
                         "generative runner reads the checkpoint's config.json as it is)")
    return LLMEngine(config, on_fault)
