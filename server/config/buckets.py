"""Warmup and bucketing: the reference's ``VLLM_*`` knobs, and ``hpu-serve buckets --suggest``."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from server.config.fields import build, derived, flag, knob, parse_bool
from server.config.server import API_KEY_ENV


@dataclass(frozen=True, slots=True)
class WarmupConfig:
    """The reference's warmup / graph-memory knobs, with its defaults."""

    skip: bool = knob(False, env="VLLM_SKIP_WARMUP",
                      help="serve without compiling or capturing every bucket first")
    graph_reserved_mem: float = knob(
        0.1, env="VLLM_GRAPH_RESERVED_MEM",
        help="fraction of the free device memory kept for captured graphs")
    graph_prompt_ratio: float = knob(0.3, env="VLLM_GRAPH_PROMPT_RATIO",
                                     help="share of the graph memory for prompt graphs")
    prompt_strategy: str = knob("min_tokens", env="VLLM_GRAPH_PROMPT_STRATEGY",
                                help="which prompt buckets get graphs first: min_tokens or max_bs")
    decode_strategy: str = knob("max_bs", env="VLLM_GRAPH_DECODE_STRATEGY",
                                help="which decode buckets get graphs first: min_tokens or max_bs")

    def __post_init__(self) -> None:
        for name in ("graph_reserved_mem", "graph_prompt_ratio"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"VLLM_{name.upper()} must be in [0, 1]")
        for name in ("prompt_strategy", "decode_strategy"):
            if getattr(self, name) not in ("min_tokens", "max_bs"):
                raise ValueError(f"VLLM_GRAPH_{name.split('_')[0].upper()}_STRATEGY must be "
                                 "min_tokens or max_bs")


# (min, step, max) of one bucket dimension; None where the user left the default.
DimOverride = tuple[int | None, int | None, int | None]


def _dim(phase: str, name: str) -> tuple[str, str, str]:
    """The three variables of one bucket dimension: VLLM_{phase}_{name}_BUCKET_{MIN,STEP,MAX}."""
    stem = f"VLLM_{phase}_{name}_BUCKET_"
    return stem + "MIN", stem + "STEP", stem + "MAX"


STRATEGY_ENV = "VLLM_BUCKETING_STRATEGY"


def _strategy_from_env(env: Mapping[str, str]) -> str | None:
    """VLLM_BUCKETING_STRATEGY, else the older VLLM_EXPONENTIAL_BUCKETING=false (lin)."""
    strategy = env.get(STRATEGY_ENV, "").strip().lower()
    if strategy:
        return strategy
    exponential = env.get("VLLM_EXPONENTIAL_BUCKETING", "").strip()
    if exponential and not parse_bool(exponential):
        return "lin"
    return None


@dataclass(frozen=True, slots=True)
class BucketingConfig:
    """The reference's bucketing knobs, parsed and checked at start-up. Defaults that depend
    on the model's limits (``None`` here) are resolved by ``server.hpu.buckets.plan``."""

    enabled: bool = knob(True, env="VLLM_ENABLE_BUCKETING",
                         help="pad shapes to warmed-up buckets (false: every shape as it comes)")
    strategy: str = flag(
        "exp", name="bucketing-strategy", choices=("exp", "lin", "adaptive"),
        env=STRATEGY_ENV, env_reader=_strategy_from_env,
        help="bucket plan (default: exp; VLLM_EXPONENTIAL_BUCKETING=false: lin); adaptive: exp "
             "plus buckets warmed while serving where the observed traffic pads a lot")
    file: str | None = knob(None, env="VLLM_BUCKETING_FROM_FILE",
                            help="a file of buckets; overrides the strategy")
    # "lin" reads all of these; "exp" only VLLM_PROMPT_BS_BUCKET_MAX, like the reference
    prompt_bs: DimOverride = knob((None, None, None), env=_dim("PROMPT", "BS"),
                                  help="batch sizes of prompt buckets (min, step, max)")
    prompt_seq: DimOverride = knob((None, None, None), env=_dim("PROMPT", "SEQ"),
                                   help="query tokens of prompt buckets (min, step, max)")
    prompt_ctx: DimOverride = knob(
        (None, None, None), env=_dim("PROMPT", "CTX"),
        help="context blocks of prompt buckets (prefix caching, chunks; min, step, max)")
    decode_bs: DimOverride = knob((None, None, None), env=_dim("DECODE", "BS"),
                                  help="batch sizes of decode buckets (min, step, max)")
    decode_block: DimOverride = knob((None, None, None), env=_dim("DECODE", "BLOCK"),
                                     help="KV blocks of decode buckets (min, step, max)")
    adaptive: bool = derived(
        False, help="the exp plan, plus buckets added while serving where observed traffic "
                    "pads a lot (server.hpu.buckets.adaptive): --bucketing-strategy adaptive")
    adaptive_interval: int = knob(256, env="HPU_SERVE_ADAPTIVE_INTERVAL",
                                  help="adaptive bucketing: steps between re-plans")
    adaptive_min_saving: float = knob(
        0.01, env="HPU_SERVE_ADAPTIVE_MIN_SAVING",
        help="adaptive bucketing: least saving, as a share of computed tokens, worth a bucket")
    adaptive_max_added: int = knob(32, env="HPU_SERVE_ADAPTIVE_MAX_ADDED",
                                   help="adaptive bucketing: most buckets added while serving")

    def __post_init__(self) -> None:
        if self.strategy == "adaptive":  # the exp plan, grown while serving
            object.__setattr__(self, "strategy", "exp")
            object.__setattr__(self, "adaptive", True)
        if self.strategy not in ("exp", "lin"):
            raise ValueError("VLLM_BUCKETING_STRATEGY must be exp, lin or adaptive, got "
                             f"{self.strategy!r}")
        if self.file is not None and not os.path.isfile(self.file):
            raise ValueError(f"VLLM_BUCKETING_FROM_FILE: no such file {self.file!r}")
        if self.adaptive_interval < 1:
            raise ValueError("HPU_SERVE_ADAPTIVE_INTERVAL must be >= 1")


def bucketing_config_from_env(environ: Mapping[str, str] | None = None,
                              strategy: str | None = None) -> BucketingConfig:
    """Parses the ``VLLM_*`` bucketing variables; a bad value fails naming the variable.
    ``strategy`` (``--bucketing-strategy``) takes precedence over VLLM_BUCKETING_STRATEGY."""
    return build(BucketingConfig, {"bucketing_strategy": strategy}, environ)


FIT = "fitting a plan to observed traffic"


@dataclass(frozen=True, slots=True)
class BucketFitOptions:
    """``hpu-serve buckets --suggest``: a bucket file fitted to the shapes a server saw
    (``server.hpu.buckets.suggest`` reads these flags)."""

    suggest: bool = flag(False, group=FIT,
                         help="write a bucket file fitted to the shapes a server observed")
    source: str | None = flag(
        None, name="from", dest="source", metavar="URL_OR_JSON", group=FIT,
        help="a server's base URL (GET /buckets/observed) or a saved JSON dump")
    api_key: str | None = flag(None, env=API_KEY_ENV, group=FIT,
                               help="bearer key for --from URL")
    max_buckets: int | None = flag(None, group=FIT, exclusive="budget",
                                   help="at most this many buckets (prompt + decode)")
    warmup_budget: float | None = flag(
        None, metavar="SECONDS", group=FIT, exclusive="budget",
        help="at most this much estimated warmup (from measured per-bucket costs); default: "
             "the current plan's, or its bucket count")
    kv_weight: float | None = flag(
        None, group=FIT, help="cost of a padded KV position in padded query tokens (default "
                              "1/256)")
    query_step: int | None = flag(
        None, metavar="TOKENS", group=FIT,
        help="prompt query buckets are multiples of this (default 32; the reference's plans "
             "step by the block size)")
    observed_only: bool = flag(
        False, group=FIT, help="cover only the observed envelope, not the engine's limits "
                               "(fewer buckets; larger traffic then misses and compiles)")
    output: str = flag("buckets.suggested.txt", aliases=("-o",), group=FIT,
                       help="the VLLM_BUCKETING_FROM_FILE file to write")
