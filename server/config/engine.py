"""The engine's whole configuration, and its flags: ``vllm serve``'s names, built from the fields."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass

from server.config.buckets import BucketingConfig, WarmupConfig
from server.config.compat import GROUP as NO_OP_GROUP
from server.config.compat import VllmNoOpFlags
from server.config.device import DeviceConfig, ParallelConfig
from server.config.fields import add_flags, build, knob, section
from server.config.lora import GROUP as LORA_GROUP
from server.config.lora import LoRAConfig
from server.config.model import CacheConfig, ModelOptions
from server.config.multimodal import GROUP as MM_GROUP
from server.config.multimodal import MultiModalConfig
from server.config.pooling import PoolingConfig
from server.config.scheduler import SchedulerConfig
from server.config.server import FairShare, ServerConfig
from server.config.speculative import GROUP as SPEC_GROUP
from server.config.speculative import SpeculativeConfig
from server.config.structured import StructuredOutputsConfig


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything the engine needs; built once and passed down."""

    model: ModelOptions = section(ModelOptions)
    cache: CacheConfig = section(CacheConfig)
    scheduler: SchedulerConfig = section(SchedulerConfig)
    device: DeviceConfig = section(DeviceConfig)
    warmup: WarmupConfig = section(WarmupConfig)
    bucketing: BucketingConfig = section(BucketingConfig)
    parallel: ParallelConfig = section(ParallelConfig)
    structured_outputs: StructuredOutputsConfig = section(StructuredOutputsConfig)
    pooling: PoolingConfig = section(PoolingConfig)
    lora: LoRAConfig = section(LoRAConfig, group=LORA_GROUP)
    speculative: SpeculativeConfig = section(SpeculativeConfig, group=SPEC_GROUP)
    multimodal: MultiModalConfig = section(MultiModalConfig, group=MM_GROUP)
    vllm_no_op: VllmNoOpFlags = section(VllmNoOpFlags, group=NO_OP_GROUP)
    cache_dir: str | None = knob(
        None, env="HPU_SERVE_CACHE_DIR",
        help="what start-up builds once and reuses on restarts: the fused CPU kernels and GGUF "
             "tokenizers converted to Hugging Face files (unset: ~/.cache/hpu-serve, or a "
             "temporary folder where that is not writable)")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The ``vllm serve`` engine flags this daemon understands."""
    add_flags(parser, EngineConfig)


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """The HTTP server's flags."""
    add_flags(parser, ServerConfig)


def engine_config_from_args(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> EngineConfig:
    """The engine's config from parsed flags and the environment (``os.environ`` unless
    given). The scheduler shares out the batch when the server's ``--fair-share`` is on
    (a parser without the server's flags: off)."""
    fair_share = FairShare(getattr(args, "fair_share", None) or FairShare.OFF)
    return build(EngineConfig, args, environ,
                 derived={"scheduler.fair_share": fair_share is not FairShare.OFF})


def server_config_from_args(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> ServerConfig:
    return build(ServerConfig, args, environ)


def make_engine_config(environ: Mapping[str, str] | None = None,
                       **overrides: object) -> EngineConfig:
    """Builds a config from ``vllm serve``-style keyword names (``max_num_seqs=8``...),
    for the offline ``LLM`` class; unknown names are an error. Environment knobs apply."""
    parser = argparse.ArgumentParser(add_help=False)
    add_engine_args(parser)
    args = parser.parse_args([])
    known = vars(args)
    for key, value in overrides.items():
        if key not in known or key == "model_flag":
            raise TypeError(f"unknown engine option {key!r}")
        setattr(args, key, value)
    return engine_config_from_args(args, environ)
