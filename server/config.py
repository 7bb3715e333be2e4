"""The one typed configuration tree, built once from CLI flags and environment variables.

This is the only module that reads ``os.environ``; everything else receives the sub-config
it needs. Flag names follow ``vllm serve`` and environment knobs keep vLLM's names, so an
existing deployment's settings carry over.
"""

from __future__ import annotations

import argparse
import enum
import importlib.util
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

GiB = 1 << 30
# The step's token budget when --max-num-batched-tokens is unset: with chunked prefill the
# whole budget; without, the floor (every prompt fits whole; short contexts still batch a few).
MIN_BATCHED_TOKENS = 2048


class ExecutionMode(str, enum.Enum):
    """How shapes become device work (``--execution-mode``); ``AUTO`` is resolved by the
    platform before anything runs."""

    AUTO = "auto"
    EAGER = "eager"  # plain PyTorch, no graphs
    COMPILE = "compile"  # torch.compile per bucket shape (inductor, or Gaudi's hpu_backend)
    GRAPHS = "graphs"  # captured device graphs per bucket (CUDA graphs, HPU graphs)

    def __str__(self) -> str:
        return self.value


class FairShare(str, enum.Enum):
    """Who counts as one client for fair admission and per-client limits (``--fair-share``)."""

    OFF = "off"  # first come, first served (per-client limits then key by address)
    API_KEY = "api-key"  # the bearer key of the request
    ADDRESS = "address"  # the peer's IP address

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class ModelOptions:
    """Which weights to serve and how to hold them."""

    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct GGUF
    dtype: str = "auto"
    served_model_name: str | None = None
    chat_template: str | None = None
    seed: int = 0
    # None: a GGUF file's Q4_0/Q4_1 weights also run 4-bit for small decode batches
    # ("gguf"); "none": every weight dequantized to ``dtype``.
    quantization: str | None = None


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Paged KV cache geometry and budget."""

    block_size: int = 128
    gpu_memory_utilization: float = 0.9
    # CPU has no "free device memory" to take a fraction of: an explicit bound instead.
    cpu_kvcache_space_bytes: int = 4 * GiB
    num_blocks_override: int | None = None
    # auto: the model's dtype; fp8 / fp8_e4m3: float8 e4m3 storage (half of bf16's bytes),
    # upcast where attention reads it
    kv_cache_dtype: str = "auto"
    # share full KV blocks between requests with the same token prefix (on, as in vLLM)
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"--block-size must be >= 1, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("--gpu-memory-utilization must be in (0, 1]")
        if self.num_blocks_override is not None and self.num_blocks_override < 1:
            raise ValueError("--num-gpu-blocks-override must be >= 1")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Batch limits. ``None`` fields are derived from the model once it is loaded."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    # fcfs: arrival order; priority: the request's ``priority`` (lower first), then arrival
    policy: str = "fcfs"
    # split prompts over steps under the token budget, decodes first (eager execution)
    enable_chunked_prefill: bool = True
    # admission round-robins over clients' waiting queues, and a client holding more than its
    # share of the batch is preempted first when another client waits (--fair-share != off)
    fair_share: bool = False

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError("--max-num-seqs must be >= 1")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError("--scheduling-policy must be fcfs or priority")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError("--max-model-len must be >= 1")

    def batched_tokens_for(self, max_model_len: int, chunked: bool = False,
                           chunked_default: int = MIN_BATCHED_TOKENS) -> int:
        """The step's token budget once ``max_model_len`` is known: with chunked prefill a
        fixed default, the platform's (prompts longer than it take several steps),
        otherwise at least one whole prompt of the longest kind."""
        if self.max_num_batched_tokens:
            return self.max_num_batched_tokens
        return chunked_default if chunked else max(max_model_len, MIN_BATCHED_TOKENS)


@dataclass(frozen=True, slots=True)
class SchedulerLimits:
    """Resolved batch limits (no ``None``: the model is known by now), resolved once per
    rank by ``server.engine.worker.builder.resolve_limits`` and passed around from there."""

    max_num_seqs: int
    max_num_batched_tokens: int  # the step's token budget
    max_model_len: int
    policy: str = "fcfs"
    # prompts split over steps under the token budget, decodes first (mixed steps)
    chunked_prefill: bool = False
    # static shapes: a prefill after a context (cached prefix, earlier chunks) runs as its
    # own batch, as the prompt buckets with context blocks have batch size 1
    context_prefill_alone: bool = False
    # admission round-robins over clients (Sequence.client); see Scheduler
    fair_share: bool = False

    @classmethod
    def resolve(cls, config: SchedulerConfig, model_max_len: int,
                chunked_prefill: bool | None = None,
                context_prefill_alone: bool = False,
                default_max_num_batched_tokens: int = MIN_BATCHED_TOKENS) -> SchedulerLimits:
        """The flags' limits with the model's defaults filled in, checked against it.
        ``chunked_prefill`` overrides the flag; ``default_max_num_batched_tokens``: the
        platform's step budget with chunked prefill when ``--max-num-batched-tokens`` is
        unset."""
        chunked = config.enable_chunked_prefill if chunked_prefill is None else chunked_prefill
        max_model_len = config.max_model_len or model_max_len
        if max_model_len > model_max_len:
            raise ValueError(f"--max-model-len {max_model_len} exceeds the model's "
                             f"{model_max_len}")
        max_num_batched_tokens = config.batched_tokens_for(max_model_len, chunked,
                                                           default_max_num_batched_tokens)
        if max_num_batched_tokens < max_model_len and not chunked:
            # Without chunked prefill a whole prompt must fit one step's token budget.
            raise ValueError(
                f"--max-num-batched-tokens ({max_num_batched_tokens}) must be >= "
                f"--max-model-len ({max_model_len}) since prompts are not chunked "
                "(--no-enable-chunked-prefill)")
        return cls(config.max_num_seqs, max_num_batched_tokens, max_model_len, config.policy,
                   chunked, context_prefill_alone, config.fair_share)


@dataclass(frozen=True, slots=True)
class DeviceConfig:
    """Where and how the model executes."""

    device: str = "auto"  # auto | hpu | cuda | cpu | a plugin's name
    enforce_eager: bool = False
    # auto: graphs on HPU/CUDA, eager on CPU (with the fused kernels: faster than compiled)
    execution_mode: ExecutionMode = ExecutionMode.AUTO
    hpu_lazy_mode: bool = True  # PT_HPU_LAZY_MODE
    # Eager CPU: fused C++ kernels for norms, RoPE + KV writes, SiLU and decode attention
    # (HPU_SERVE_CPU_KERNELS=0 keeps plain PyTorch ops, e.g. where no compiler exists).
    cpu_kernels: bool = True

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "execution_mode", ExecutionMode(self.execution_mode))
        except ValueError:
            raise ValueError("--execution-mode must be auto, eager, compile or graphs") from None


@dataclass(frozen=True, slots=True)
class WarmupConfig:
    """The reference's warmup / graph-memory knobs, with its defaults."""

    skip: bool = False  # VLLM_SKIP_WARMUP
    graph_reserved_mem: float = 0.1  # VLLM_GRAPH_RESERVED_MEM
    graph_prompt_ratio: float = 0.3  # VLLM_GRAPH_PROMPT_RATIO
    prompt_strategy: str = "min_tokens"  # VLLM_GRAPH_PROMPT_STRATEGY
    decode_strategy: str = "max_bs"  # VLLM_GRAPH_DECODE_STRATEGY

    def __post_init__(self) -> None:
        for name in ("graph_reserved_mem", "graph_prompt_ratio"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"VLLM_{name.upper()} must be in [0, 1]")
        for name in ("prompt_strategy", "decode_strategy"):
            if getattr(self, name) not in ("min_tokens", "max_bs"):
                raise ValueError(f"VLLM_GRAPH_{name.split('_')[0].upper()}_STRATEGY must be "
                                 "min_tokens or max_bs")


@dataclass(frozen=True, slots=True)
class StructuredOutputsConfig:
    """Bounds on grammar work (a JSON schema, regex, choice or EBNF from a request is compiled
    on the server's CPU): beyond them the request gets a 400 naming the field and the limit."""

    backend: str = "auto"  # --structured-outputs-backend (auto: xgrammar)
    compile_timeout: float = 10.0  # seconds one grammar may take to compile
    max_bytes: int = 65536  # text of one schema / regex / grammar / choice list
    max_alternatives: int = 1024  # enum values, choices, anyOf/oneOf branches of one schema
    workers: int = 2  # grammars compiled at once (their own pool: tokenizing never waits)
    cache_size: int = 256  # compiled grammars kept (least recently used dropped)

    def __post_init__(self) -> None:
        if self.backend not in ("auto", "xgrammar"):
            raise ValueError("--structured-outputs-backend must be auto or xgrammar")
        if self.compile_timeout <= 0:
            raise ValueError("--grammar-compile-timeout must be > 0")
        for name in ("max_bytes", "max_alternatives", "workers", "cache_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{_GRAMMAR_FLAGS[name]} must be >= 1")


_GRAMMAR_FLAGS = {"max_bytes": "max-grammar-bytes", "max_alternatives": "max-grammar-alternatives",
                  "workers": "grammar-workers", "cache_size": "grammar-cache-size"}


# (min, step, max) of one bucket dimension; None where the user left the default.
DimOverride = tuple[int | None, int | None, int | None]


@dataclass(frozen=True, slots=True)
class BucketingConfig:
    """The reference's bucketing knobs, parsed and checked at start-up. Defaults that depend
    on the model's limits (``None`` here) are resolved by ``server.hpu.buckets.plan``."""

    enabled: bool = True  # VLLM_ENABLE_BUCKETING
    strategy: str = "exp"  # VLLM_BUCKETING_STRATEGY (or VLLM_EXPONENTIAL_BUCKETING=false: lin)
    file: str | None = None  # VLLM_BUCKETING_FROM_FILE: overrides the strategy
    # VLLM_{PROMPT,DECODE}_{BS,SEQ,BLOCK}_BUCKET_{MIN,STEP,MAX} (read by "lin"; "exp" reads
    # only VLLM_PROMPT_BS_BUCKET_MAX, like the reference)
    prompt_bs: DimOverride = (None, None, None)
    prompt_seq: DimOverride = (None, None, None)
    # VLLM_PROMPT_CTX_BUCKET_*: context blocks of prompt buckets (prefix caching / chunks)
    prompt_ctx: DimOverride = (None, None, None)
    decode_bs: DimOverride = (None, None, None)
    decode_block: DimOverride = (None, None, None)
    # --bucketing-strategy adaptive (or VLLM_BUCKETING_STRATEGY=adaptive): the exp plan, plus
    # buckets added while serving where observed traffic pads a lot (server.hpu.buckets.adaptive)
    adaptive: bool = False
    adaptive_interval: int = 256  # HPU_SERVE_ADAPTIVE_INTERVAL: steps between re-plans
    adaptive_min_saving: float = 0.01  # HPU_SERVE_ADAPTIVE_MIN_SAVING: of computed tokens
    adaptive_max_added: int = 32  # HPU_SERVE_ADAPTIVE_MAX_ADDED

    def __post_init__(self) -> None:
        if self.strategy not in ("exp", "lin"):
            raise ValueError(f"VLLM_BUCKETING_STRATEGY must be exp or lin, got {self.strategy!r}")
        if self.file is not None and not os.path.isfile(self.file):
            raise ValueError(f"VLLM_BUCKETING_FROM_FILE: no such file {self.file!r}")


def bucketing_config_from_env(environ: Mapping[str, str] | None = None,
                              strategy: str | None = None) -> BucketingConfig:
    """Parses the ``VLLM_*`` bucketing variables; a bad value fails naming the variable.
    ``strategy`` (``--bucketing-strategy``) takes precedence over VLLM_BUCKETING_STRATEGY."""
    env = os.environ if environ is None else environ

    def dim(phase: str, name: str) -> DimOverride:
        lo, step, hi = (_optional_int(env, f"VLLM_{phase}_{name}_BUCKET_{k}")
                        for k in ("MIN", "STEP", "MAX"))
        return lo, step, hi

    strategy = (strategy or env.get("VLLM_BUCKETING_STRATEGY", "")).strip().lower() or (
        "exp" if _bool(env, "VLLM_EXPONENTIAL_BUCKETING", True) else "lin")
    adaptive = strategy == "adaptive"
    return BucketingConfig(
        enabled=_bool(env, "VLLM_ENABLE_BUCKETING", True),
        strategy="exp" if adaptive else strategy,
        adaptive=adaptive,
        adaptive_interval=_optional_int(env, "HPU_SERVE_ADAPTIVE_INTERVAL") or 256,
        adaptive_min_saving=_float(env, "HPU_SERVE_ADAPTIVE_MIN_SAVING", 0.01),
        adaptive_max_added=_optional_int(env, "HPU_SERVE_ADAPTIVE_MAX_ADDED") or 32,
        file=env.get("VLLM_BUCKETING_FROM_FILE") or None,
        prompt_bs=dim("PROMPT", "BS"), prompt_seq=dim("PROMPT", "SEQ"),
        prompt_ctx=dim("PROMPT", "CTX"),
        decode_bs=dim("DECODE", "BS"), decode_block=dim("DECODE", "BLOCK"),
    )


def _optional_int(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from None
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """How the model is split over devices (``--tensor-parallel-size``): one process per
    rank, rank 0 being the server itself."""

    tensor_parallel_size: int = 1
    # "mp": worker processes on this host; "ray": Ray actors on a Ray cluster, possibly
    # on other hosts (vLLM's names)
    distributed_executor_backend: str = "mp"
    # seconds a collective may wait for a rank before failing (start-up included: a rank
    # that compiles its graphs keeps the others waiting that long)
    collective_timeout: float = 600.0

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError("--tensor-parallel-size must be >= 1")
        if self.distributed_executor_backend not in ("mp", "ray"):
            raise ValueError("--distributed-executor-backend must be mp or ray")
        # checked here so that a missing optional package fails before any loading
        if (self.distributed_executor_backend == "ray" and self.tensor_parallel_size > 1
                and importlib.util.find_spec("ray") is None):
            raise ValueError("--distributed-executor-backend ray needs the ray package: "
                             "pip install 'hpu-serve[ray]'")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything the engine needs; built once and passed down."""

    model: ModelOptions = field(default_factory=ModelOptions)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    bucketing: BucketingConfig = field(default_factory=BucketingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    structured_outputs: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    # What start-up builds once and reuses on restarts: the fused CPU kernels and GGUF
    # tokenizers converted to Hugging Face files (HPU_SERVE_CACHE_DIR; None: the default
    # ~/.cache/hpu-serve, or a temp dir where that is not writable).
    cache_dir: str | None = None


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The ``vllm serve`` engine flags this daemon understands."""
    parser.add_argument("model", nargs="?", default=None,
                        help="HF folder or .gguf file; default: embedded SmolLM2-135M-Instruct")
    parser.add_argument("--model", dest="model_flag", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="auto",
                        choices=["auto", "bfloat16", "float16", "float32"])
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--chat-template", default=None, help="Jinja template or a file with one")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quantization", "-q", default=None,
                        choices=["gguf", "none", "gptq", "awq", "fp8", "compressed-tensors"],
                        help="gguf (default for .gguf files): Q4_0/Q4_1 weights stay 4-bit for "
                             "decode batches of up to 4 rows (bf16 on CPU); none: dequantize "
                             "everything to --dtype; gptq, awq, fp8, compressed-tensors: what "
                             "config.json says the checkpoint is (read from it when unset; "
                             "dequantized at load)")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                        help="fcfs: arrival order; priority: the request field priority "
                             "(lower first, ties by arrival), lowest priority preempted first")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="tokens one step computes (default with chunked prefill: 512 on "
                             "CPU, 2048 on accelerators; else max(--max-model-len, 2048))")
    parser.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                        default=True,
                        help="split long prompts over steps within --max-num-batched-tokens, "
                             "running decodes first in every step (with graphs, a chunk "
                             "after the first runs alone in a prompt bucket with context blocks)")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--num-gpu-blocks-override", type=int, default=None)
    parser.add_argument("--bucketing-strategy", default=None, choices=["exp", "lin", "adaptive"],
                        help="bucket plan (default: VLLM_BUCKETING_STRATEGY, else exp); "
                             "adaptive: exp plus buckets warmed while serving where the "
                             "observed traffic pads a lot")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=True,
                        help="reuse the KV blocks of a prompt prefix computed before (full "
                             "blocks, chained hashes)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                        help="fp8: store K/V as float8 e4m3 (half the bytes of bf16), upcast "
                             "in attention; on CPU this runs PyTorch attention, not the fused "
                             "kernels")
    parser.add_argument("--device", default="auto",
                        help="auto, or a platform name: hpu, cuda, cpu or a plugin's")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--structured-outputs-backend", "--guided-decoding-backend",
                        dest="structured_outputs_backend", default="auto",
                        choices=["auto", "xgrammar"],
                        help="grammar engine of response_format / guided_* / "
                             "structured_outputs (auto: xgrammar)")
    grammar = parser.add_argument_group("grammar bounds (beyond them: 400 naming the field)")
    grammar.add_argument("--grammar-compile-timeout", type=float, default=10.0,
                         help="seconds one grammar may take to compile")
    grammar.add_argument("--max-grammar-bytes", type=int, default=65536,
                         help="size of one schema, regex, grammar or choice list")
    grammar.add_argument("--max-grammar-alternatives", type=int, default=1024,
                         help="enum values, choices or anyOf/oneOf branches in one constraint")
    grammar.add_argument("--grammar-workers", type=int, default=2,
                         help="grammars compiled at once, in their own pool")
    grammar.add_argument("--grammar-cache-size", type=int, default=256,
                         help="compiled grammars kept for reuse (least recently used dropped)")
    parser.add_argument("--execution-mode", default="auto",
                        choices=["auto", "eager", "compile", "graphs"],
                        help="auto: HPU/CUDA graphs on accelerators, eager on CPU")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                        help="split every layer over this many devices, one "
                             "process per rank (torch.distributed: hccl on Gaudi, nccl on "
                             "CUDA, gloo on CPU)")
    parser.add_argument("--distributed-executor-backend", default="mp", choices=["mp", "ray"],
                        help="how the ranks run: mp (worker processes on this host) or ray "
                             "(Ray actors on the Ray cluster of RAY_ADDRESS, or of this "
                             "host, started if none runs; needs hpu-serve[ray])")


def engine_config_from_args(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> EngineConfig:
    env = os.environ if environ is None else environ
    kv_space_gib = _float(env, "VLLM_CPU_KVCACHE_SPACE", 4.0)
    return EngineConfig(
        model=ModelOptions(
            model=args.model or args.model_flag,
            dtype=args.dtype,
            served_model_name=args.served_model_name,
            chat_template=args.chat_template,
            seed=args.seed,
            quantization=args.quantization,
        ),
        cache=CacheConfig(
            block_size=args.block_size,
            gpu_memory_utilization=args.gpu_memory_utilization,
            cpu_kvcache_space_bytes=int(kv_space_gib * GiB),
            num_blocks_override=args.num_gpu_blocks_override,
            kv_cache_dtype=args.kv_cache_dtype,
            enable_prefix_caching=args.enable_prefix_caching,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            policy=args.scheduling_policy,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
            enable_chunked_prefill=args.enable_chunked_prefill,
            fair_share=FairShare(getattr(args, "fair_share", "off")) is not FairShare.OFF,
        ),
        device=DeviceConfig(device=args.device, enforce_eager=args.enforce_eager,
                            execution_mode=args.execution_mode,
                            hpu_lazy_mode=_bool(env, "PT_HPU_LAZY_MODE", True),
                            cpu_kernels=_bool(env, "HPU_SERVE_CPU_KERNELS", True)),
        warmup=WarmupConfig(
            skip=_bool(env, "VLLM_SKIP_WARMUP", False),
            graph_reserved_mem=_float(env, "VLLM_GRAPH_RESERVED_MEM", 0.1),
            graph_prompt_ratio=_float(env, "VLLM_GRAPH_PROMPT_RATIO", 0.3),
            prompt_strategy=env.get("VLLM_GRAPH_PROMPT_STRATEGY", "min_tokens"),
            decode_strategy=env.get("VLLM_GRAPH_DECODE_STRATEGY", "max_bs"),
        ),
        bucketing=bucketing_config_from_env(env, getattr(args, "bucketing_strategy", None)),
        parallel=ParallelConfig(
            tensor_parallel_size=args.tensor_parallel_size,
            distributed_executor_backend=args.distributed_executor_backend,
            collective_timeout=_float(env, "HPU_SERVE_COLLECTIVE_TIMEOUT", 600.0),
        ),
        structured_outputs=StructuredOutputsConfig(
            backend=args.structured_outputs_backend,
            compile_timeout=args.grammar_compile_timeout,
            max_bytes=args.max_grammar_bytes,
            max_alternatives=args.max_grammar_alternatives,
            workers=args.grammar_workers,
            cache_size=args.grammar_cache_size,
        ),
        cache_dir=env.get("HPU_SERVE_CACHE_DIR") or None,
    )


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name, "").strip().lower()
    if not raw:
        return default
    if raw not in _TRUE + _FALSE:
        raise ValueError(f"{name} must be true or false (1/0, yes/no, on/off), got {raw!r}")
    return raw in _TRUE


def _float(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number, got {raw!r}") from None


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


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What one API request may ask for; beyond it the answer is 400 naming the field.

    ``max_logprobs`` is vLLM's flag; the others have no vLLM counterpart. OpenAI's own
    ranges (top_logprobs <= 20, completions logprobs <= 5, n <= 128...) always apply.
    """

    max_logprobs: int = 20
    max_stop_strings: int = 4  # OpenAI's limit
    max_stop_token_ids: int = 1024
    max_logit_bias: int = 1024
    max_messages: int = 1024
    max_prompts: int = 128
    # prompts x n x max_tokens of one call (max_tokens unset counts as the context length)
    max_tokens_per_request: int = 131072
    # prompts x n of one call: sequences it adds to the batch
    max_seqs_per_request: int = 256

    def __post_init__(self) -> None:
        for f in fields(self):
            least = 0 if f.name == "max_logprobs" else 1  # 0 logprobs: none may be asked
            if getattr(self, f.name) < least:
                raise ValueError(f"--{f.name.replace('_', '-')} must be >= {least}")


@dataclass(frozen=True, slots=True)
class ChatOptions:
    """How chat answers are read back: tool calls and reasoning (vLLM's flag names)."""

    enable_auto_tool_choice: bool = False  # tool_choice "auto" needs a parser too
    tool_call_parser: str | None = None  # hermes, llama3_json, mistral, pythonic
    reasoning_parser: str | None = None  # deepseek_r1, qwen3

    def __post_init__(self) -> None:
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """HTTP-side settings of ``hpu-serve serve``."""

    host: str = "0.0.0.0"
    port: int = 8000
    api_key: str | None = None
    max_waiting_requests: int = 1024  # 0: unbounded
    max_body_bytes: int = 16 * 1024 * 1024
    shutdown_timeout: float = 30.0
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    log_level: str = "info"
    disable_access_log: bool = False
    limits: RequestLimits = field(default_factory=RequestLimits)
    chat: ChatOptions = field(default_factory=ChatOptions)
    # Connections (uvicorn's names where it has them)
    timeout_keep_alive: float = 5.0  # idle time between requests on one connection
    timeout_request_header: float = 20.0  # from a request's first byte to its headers' end
    timeout_request_body: float = 30.0  # longest pause while a body is being received
    limit_concurrency: int = 512  # requests served at once; 0: unbounded
    # a connection that has sent no byte yet: seconds until it is closed, and how many such
    # connections one address may hold (more are closed at once)
    timeout_idle_connection: float = 5.0
    max_idle_connections_per_address: int = 64
    # who one client is (--fair-share): fair admission, and the key of --max-client-seqs
    fair_share: FairShare = FairShare.ADDRESS
    max_client_seqs: int = 0  # sequences one client may have in the engine; 0: unbounded
    # threads for work whose cost grows with the input (tokenize, render, logprobs,
    # serializing big answers): off the event loop, one client's share bounded
    preprocess_workers: int = 4
    # /health answers 503 when the engine has work but has not finished a step this long
    health_stall_timeout: float = 120.0
    max_request_id_length: int = 256  # X-Request-Id longer than this: 400

    def __post_init__(self) -> None:
        for name in ("timeout_keep_alive", "timeout_request_header", "timeout_request_body"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0")
        if self.limit_concurrency < 0:
            raise ValueError("--limit-concurrency must be >= 0 (0: unbounded)")
        for name in ("timeout_idle_connection", "health_stall_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0")
        for name in ("max_idle_connections_per_address", "preprocess_workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.max_client_seqs < 0 or self.max_waiting_requests < 0:
            raise ValueError("--max-client-seqs and --max-waiting-requests must be >= 0 "
                             "(0: unbounded)")


def add_server_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None, help="or VLLM_API_KEY; protects /v1/*, "
                        "/reset_prefix_cache and /buckets/observed")
    parser.add_argument("--max-waiting-requests", type=int, default=1024,
                        help="answer 503 with Retry-After once this many requests wait "
                             "(0: unbounded)")
    parser.add_argument("--max-request-body-bytes", type=int, default=16 * 1024 * 1024,
                        help="larger bodies (declared or chunked) are answered 413")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds in-flight requests get to finish after SIGTERM")
    limits = parser.add_argument_group("request limits (beyond them: 400 naming the field)")
    limits.add_argument("--max-logprobs", type=int, default=20,
                        help="top logprobs per token (chat top_logprobs, completions logprobs; "
                             "OpenAI's own caps of 20 and 5 apply too)")
    limits.add_argument("--max-stop-strings", type=int, default=4,
                        help="stop strings per request (OpenAI allows 4)")
    limits.add_argument("--max-stop-token-ids", type=int, default=1024,
                        help="stop_token_ids per request")
    limits.add_argument("--max-logit-bias", type=int, default=1024,
                        help="logit_bias entries per request")
    limits.add_argument("--max-messages", type=int, default=1024,
                        help="chat messages per request")
    limits.add_argument("--max-prompts", type=int, default=128,
                        help="prompts in one completions request")
    limits.add_argument("--max-tokens-per-request", type=int, default=131072,
                        help="prompts x n x max_tokens of one request (an unset max_tokens "
                             "counts as the context length)")
    limits.add_argument("--max-seqs-per-request", type=int, default=256,
                        help="prompts x n of one request (the sequences it adds to the batch)")
    fair = parser.add_argument_group("fairness between clients")
    fair.add_argument("--fair-share", default="address", choices=[f.value for f in FairShare],
                      help="who one client is: admission round-robins over clients' waiting "
                           "requests, and a client over its share of the batch is preempted "
                           "first when another waits (off: first come, first served)")
    fair.add_argument("--max-client-seqs", type=int, default=0,
                      help="sequences one client (--fair-share's key; the address when off) "
                           "may have waiting or running; beyond: 429 with Retry-After "
                           "(0: unbounded)")
    fair.add_argument("--preprocess-workers", type=int, default=4,
                      help="threads that tokenize, render templates and serialize big answers "
                           "off the event loop (one client gets at most half)")
    fair.add_argument("--health-stall-timeout", type=float, default=120.0,
                      help="/health answers 503 once the engine has had work but finished no "
                           "step for this many seconds")
    chat = parser.add_argument_group("tool calls and reasoning")
    chat.add_argument("--enable-auto-tool-choice", action="store_true",
                      help="let the model decide to call tools (tool_choice auto); needs "
                           "--tool-call-parser")
    chat.add_argument("--tool-call-parser", default=None,
                      help="how the model writes tool calls: hermes, llama3_json, mistral, "
                           "pythonic")
    chat.add_argument("--reasoning-parser", default=None,
                      help="split reasoning_content from content: deepseek_r1, qwen3")
    conns = parser.add_argument_group("connections")
    conns.add_argument("--timeout-keep-alive", type=float, default=5.0,
                       help="seconds an idle keep-alive connection stays open")
    conns.add_argument("--timeout-request-header", type=float, default=20.0,
                       help="seconds a client has to send a request's headers (from the "
                            "request's first byte); then 408 and close")
    conns.add_argument("--timeout-request-body", type=float, default=30.0,
                       help="longest pause, in seconds, while a request body is received; "
                            "then 408 and close")
    conns.add_argument("--limit-concurrency", type=int, default=512,
                       help="requests served at once; one more is answered 503 (0: unbounded; "
                            "/health is always served; idle connections do not count)")
    conns.add_argument("--timeout-idle-connection", type=float, default=5.0,
                       help="seconds a new connection may stay silent before it is closed")
    conns.add_argument("--max-idle-connections-per-address", type=int, default=64,
                       help="silent connections one address may hold; more are closed")
    parser.add_argument("--allowed-origins", nargs="*", default=["*"])
    parser.add_argument("--allowed-methods", nargs="*", default=["*"])
    parser.add_argument("--allowed-headers", nargs="*", default=["*"])
    parser.add_argument("--allow-credentials", action="store_true")
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=["debug", "info", "warning", "error", "critical"])
    parser.add_argument("--disable-uvicorn-access-log", action="store_true")


def api_key_from_env(given: str | None, environ: Mapping[str, str] | None = None) -> str | None:
    """``--api-key`` if given, else ``VLLM_API_KEY`` (the server's rule, for clients too)."""
    env = os.environ if environ is None else environ
    return given or env.get("VLLM_API_KEY") or None


def server_config_from_args(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> ServerConfig:
    env = os.environ if environ is None else environ
    return ServerConfig(
        host=args.host,
        port=args.port,
        api_key=args.api_key or env.get("VLLM_API_KEY") or None,
        max_waiting_requests=args.max_waiting_requests,
        max_body_bytes=args.max_request_body_bytes,
        shutdown_timeout=args.shutdown_timeout,
        allowed_origins=tuple(args.allowed_origins),
        allowed_methods=tuple(args.allowed_methods),
        allowed_headers=tuple(args.allowed_headers),
        allow_credentials=args.allow_credentials,
        log_level=args.uvicorn_log_level,
        disable_access_log=args.disable_uvicorn_access_log,
        limits=RequestLimits(
            max_logprobs=args.max_logprobs, max_stop_strings=args.max_stop_strings,
            max_stop_token_ids=args.max_stop_token_ids, max_logit_bias=args.max_logit_bias,
            max_messages=args.max_messages, max_prompts=args.max_prompts,
            max_tokens_per_request=args.max_tokens_per_request,
            max_seqs_per_request=args.max_seqs_per_request,
        ),
        chat=ChatOptions(enable_auto_tool_choice=args.enable_auto_tool_choice,
                         tool_call_parser=args.tool_call_parser,
                         reasoning_parser=args.reasoning_parser),
        timeout_keep_alive=args.timeout_keep_alive,
        timeout_request_header=args.timeout_request_header,
        timeout_request_body=args.timeout_request_body,
        limit_concurrency=args.limit_concurrency,
        timeout_idle_connection=args.timeout_idle_connection,
        max_idle_connections_per_address=args.max_idle_connections_per_address,
        fair_share=FairShare(args.fair_share),
        max_client_seqs=args.max_client_seqs,
        preprocess_workers=args.preprocess_workers,
        health_stall_timeout=args.health_stall_timeout,
    )
