"""The one typed configuration tree, built once from CLI flags and environment variables.

Each config dataclass field declares its own flag or environment variable, help text and
default (``fields``); the parsers of ``hpu-serve serve``, ``buckets`` and ``bench`` are
generated from them. This package is the only code that reads ``os.environ``; everything
else receives the sub-config it needs. Flag names follow ``vllm serve`` and environment knobs
keep vLLM's names, so an existing deployment's settings carry over.
"""

from server.config.batch import BatchOptions
from server.config.bench import BenchOptions
from server.config.buckets import (
    BucketFitOptions,
    BucketingConfig,
    DimOverride,
    WarmupConfig,
    bucketing_config_from_env,
)
from server.config.device import DeviceConfig, ExecutionMode, ParallelConfig
from server.config.engine import (
    EngineConfig,
    add_engine_args,
    add_server_args,
    engine_config_from_args,
    make_engine_config,
    server_config_from_args,
)
from server.config.logging import LogFormat, LoggingConfig
from server.config.lora import LoRAConfig
from server.config.model import CacheConfig, GiB, ModelOptions
from server.config.multimodal import MultiModalConfig
from server.config.pooling import Convert, PoolingConfig, Runner
from server.config.responses import ResponsesStoreConfig
from server.config.scheduler import MIN_BATCHED_TOKENS, SchedulerConfig, SchedulerLimits
from server.config.server import (
    ChatOptions,
    FairShare,
    RequestLimits,
    ServerConfig,
    api_key_from_env,
)
from server.config.speculative import (
    SpecMethod,
    SpeculativeConfig,
    SpeculativeSettings,
    parse_speculative_config,
)
from server.config.structured import StructuredOutputsBackend, StructuredOutputsConfig
from server.config.tracing import OtlpProtocol, TracingConfig

__all__ = [
    "MIN_BATCHED_TOKENS", "BatchOptions", "BenchOptions", "BucketFitOptions", "BucketingConfig", "CacheConfig",
    "ChatOptions", "Convert", "DeviceConfig", "DimOverride", "EngineConfig", "ExecutionMode",
    "FairShare", "GiB", "LoRAConfig", "LogFormat", "LoggingConfig", "ModelOptions",
    "MultiModalConfig",
    "OtlpProtocol", "ParallelConfig", "PoolingConfig", "RequestLimits", "ResponsesStoreConfig",
    "Runner", "SchedulerConfig", "SpecMethod", "SpeculativeConfig", "SpeculativeSettings",
    "SchedulerLimits", "ServerConfig", "StructuredOutputsBackend", "StructuredOutputsConfig",
    "TracingConfig", "WarmupConfig", "add_engine_args", "add_server_args", "api_key_from_env",
    "bucketing_config_from_env", "engine_config_from_args", "make_engine_config", "parse_speculative_config",
    "server_config_from_args",
]
