"""The typed configuration: vLLM's flags and variables, checked at start-up, and the config
dataclasses as the single source of every flag (name, help, variable, default)."""

import argparse
import dataclasses
import inspect
from collections import Counter

import pytest

import server.config as config_pkg
from server.config import (
    BatchOptions,
    BenchOptions,
    BucketFitOptions,
    EngineConfig,
    GiB,
    ServerConfig,
    StructuredOutputsBackend,
    StructuredOutputsConfig,
    add_engine_args,
    api_key_from_env,
    engine_config_from_args,
    make_engine_config,
    server_config_from_args,
)
from server.config.fields import (
    Source,
    add_flags,
    build,
    dest_of,
    flag,
    knob,
    spec_of,
    walk,
)


def parse(argv: list[str], env: dict[str, str] | None = None):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return engine_config_from_args(parser.parse_args(argv), env or {})


def test_vllm_flags_and_env_knobs() -> None:
    cfg = parse(
        ["/models/x", "--max-num-seqs", "64", "--max-model-len", "4096", "--block-size", "64",
         "--gpu-memory-utilization", "0.5", "--enforce-eager", "--dtype", "float32",
         "--served-model-name", "my-model", "--max-num-batched-tokens", "8192"],
        {"VLLM_CPU_KVCACHE_SPACE": "2"},
    )
    assert cfg.model.model == "/models/x"
    assert cfg.model.dtype == "float32"
    assert cfg.model.served_model_name == "my-model"
    assert cfg.scheduler.max_num_seqs == 64
    assert cfg.scheduler.max_model_len == 4096
    assert cfg.scheduler.max_num_batched_tokens == 8192
    assert cfg.cache.block_size == 64
    assert cfg.cache.gpu_memory_utilization == 0.5
    assert cfg.cache.cpu_kvcache_space_bytes == 2 * GiB
    assert cfg.device.enforce_eager


def test_defaults_follow_the_reference() -> None:
    cfg = parse([])
    assert cfg.model.model is None  # the embedded default model
    assert cfg.cache.block_size == 128
    assert cfg.scheduler.max_num_seqs == 256
    assert cfg.cache.cpu_kvcache_space_bytes == 4 * GiB


@pytest.mark.parametrize("flags", [["--block-size", "0"], ["--gpu-memory-utilization", "1.5"],
                                   ["--max-num-seqs", "0"]])
def test_invalid_values_fail_at_startup(flags: list[str]) -> None:
    with pytest.raises(ValueError):
        parse(flags)


def test_offline_options_reject_unknown_names() -> None:
    assert make_engine_config(max_num_seqs=3).scheduler.max_num_seqs == 3
    with pytest.raises(TypeError, match="max_num_seq"):
        make_engine_config(max_num_seq=3)


def test_example_env_file_matches_the_defaults() -> None:
    from pathlib import Path

    example = Path(__file__).resolve().parents[1] / "config" / "server.example.env"
    env = dict(line.split("=", 1) for line in example.read_text().splitlines()
               if line and not line.startswith("#"))
    from server.hpu.buckets.plan import resolve_ranges

    explicit, default = parse([], env), parse([], {})
    # the example documents the defaults, exactly
    assert explicit == default
    limits = dict(block_size=128, max_model_len=4096, max_num_seqs=64, max_num_batched_tokens=4096)
    assert resolve_ranges(explicit.bucketing, **limits) == resolve_ranges(default.bucketing,
                                                                           **limits)
    assert parse([], dict(env, VLLM_SKIP_WARMUP="true")).warmup.skip


# one parser each: the classes whose flags share it
PARSERS = [(EngineConfig, ServerConfig), (EngineConfig, ServerConfig, BatchOptions),
           (BenchOptions,), (BucketFitOptions,)]
# resolved at run time from the flags and the model, never configured directly
NOT_CONFIGURED = {"SchedulerLimits", "SpeculativeSettings"}  # resolved from flags


def config_classes() -> set[type]:
    """Every config dataclass the package exports."""
    return {obj for _, obj in inspect.getmembers(config_pkg, inspect.isclass)
            if dataclasses.is_dataclass(obj) and obj.__name__ not in NOT_CONFIGURED}


def reachable(classes: tuple[type, ...]) -> set[type]:
    """The classes and their sections (fields whose default is a config dataclass)."""
    found = set(classes)
    for cls in classes:
        for f in dataclasses.fields(cls):
            if f.default_factory is not dataclasses.MISSING:
                inner = f.default_factory()
                if dataclasses.is_dataclass(inner):
                    found |= reachable((type(inner),))
    return found


def test_every_config_class_feeds_a_parser() -> None:
    fed = set().union(*(reachable(classes) for classes in PARSERS))
    assert config_classes() - fed == set()


@pytest.mark.parametrize("classes", PARSERS, ids=lambda c: c[0].__name__)
def test_every_field_is_a_flag_or_says_why_not(classes: tuple[type, ...]) -> None:
    for cls in classes:
        for path, f, _, _ in walk(cls):
            spec = spec_of(f)
            assert spec is not None, f"{cls.__name__}.{path}: flag(), knob(), derived() or fixed()"
            assert spec.help.strip(), f"{cls.__name__}.{path} has no help"
            if spec.source is Source.KNOB:
                assert spec.env, path


@pytest.mark.parametrize("classes", PARSERS, ids=lambda c: c[0].__name__)
def test_no_two_fields_claim_one_flag_or_variable(classes: tuple[type, ...]) -> None:
    options: Counter[str] = Counter()
    dests: Counter[str] = Counter()
    variables: Counter[str] = Counter()
    for cls in classes:
        for _, f, _, _ in walk(cls):
            spec = spec_of(f)
            assert spec is not None
            if spec.source is Source.FLAG:
                options.update([f"--{spec.flag_name(f.name)}", *spec.aliases])
                dests[dest_of(f, spec)] += 1
            env = (spec.env,) if isinstance(spec.env, str) else spec.env or ()
            variables.update(env)
    for counter in (options, dests, variables):
        assert not [name for name, n in counter.items() if n > 1]


@pytest.mark.parametrize("classes", PARSERS, ids=lambda c: c[0].__name__)
def test_parsed_defaults_are_the_dataclass_defaults(classes: tuple[type, ...]) -> None:
    parser = argparse.ArgumentParser()
    add_flags(parser, *classes)
    args = parser.parse_args([])
    for cls in classes:
        assert build(cls, args, {}) == cls()


def test_serve_config_defaults_equal_the_dataclasses() -> None:
    assert parse([]) == EngineConfig()
    server_parser = argparse.ArgumentParser()
    add_flags(server_parser, ServerConfig)
    assert server_config_from_args(server_parser.parse_args([]), {}) == ServerConfig()


@dataclasses.dataclass(frozen=True)
class Toy:
    """A config class that exists only here: its one field must become a whole flag."""

    answer_len: int = flag(42, help="tokens the answer may take", env="TOY_ANSWER_LEN")
    tone: str = flag("dry", choices=("dry", "warm"), help="how the answer sounds")
    verbose_log: bool = knob(False, env="TOY_VERBOSE_LOG", help="log every step")


def test_one_new_field_is_one_new_flag() -> None:
    parser = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_flags(parser, Toy)
    text = " ".join(parser.format_help().split())
    assert "--answer-len ANSWER_LEN tokens the answer may take (env: TOY_ANSWER_LEN)" in text
    assert "--tone {dry,warm} how the answer sounds (default: dry)" in text
    assert "--verbose-log" not in text  # a knob is no flag
    assert build(Toy, parser.parse_args([]), {}) == Toy()
    assert build(Toy, parser.parse_args(["--answer-len", "7", "--tone", "warm"]), {}) == \
        Toy(answer_len=7, tone="warm")
    env = {"TOY_ANSWER_LEN": "9", "TOY_VERBOSE_LOG": "yes"}
    assert build(Toy, parser.parse_args([]), env) == Toy(answer_len=9, verbose_log=True)
    # the flag wins over its variable
    assert build(Toy, parser.parse_args(["--answer-len", "3"]), env).answer_len == 3
    with pytest.raises(SystemExit):
        parser.parse_args(["--tone", "loud"])
    with pytest.raises(ValueError, match="TOY_ANSWER_LEN must be an integer, got 'many'"):
        build(Toy, parser.parse_args([]), {"TOY_ANSWER_LEN": "many"})


def test_env_knobs_name_themselves_when_bad() -> None:
    with pytest.raises(ValueError, match="VLLM_SKIP_WARMUP must be true or false"):
        parse([], {"VLLM_SKIP_WARMUP": "maybe"})
    with pytest.raises(ValueError, match="VLLM_CPU_KVCACHE_SPACE must be a number"):
        parse([], {"VLLM_CPU_KVCACHE_SPACE": "big"})
    assert parse([], {"VLLM_CPU_KVCACHE_SPACE": "0.5"}).cache.cpu_kvcache_space_bytes == GiB // 2


def test_api_key_has_one_rule_for_server_and_clients() -> None:
    assert api_key_from_env("given", {"VLLM_API_KEY": "env"}) == "given"
    assert api_key_from_env(None, {"VLLM_API_KEY": "env"}) == "env"
    assert api_key_from_env(None, {}) is None
    parser = argparse.ArgumentParser()
    add_flags(parser, ServerConfig)
    assert server_config_from_args(parser.parse_args([]), {"VLLM_API_KEY": "env"}).api_key == "env"
    assert server_config_from_args(parser.parse_args(["--api-key", "k"]),
                                   {"VLLM_API_KEY": "env"}).api_key == "k"


def test_structured_outputs_backend_is_read_at_start_up(monkeypatch) -> None:
    cfg = parse(["--guided-decoding-backend", "xgrammar"]).structured_outputs
    assert cfg.backend is StructuredOutputsBackend.XGRAMMAR
    assert parse([]).structured_outputs.resolved_backend is StructuredOutputsBackend.XGRAMMAR
    with pytest.raises(ValueError, match="--structured-outputs-backend must be one of auto, "
                                         "xgrammar, got 'outlines'"):
        make_engine_config(structured_outputs_backend="outlines")
    with pytest.raises(ValueError, match="no such grammar backend"):
        StructuredOutputsConfig(backend="guidance")
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "xgrammar" else real(name, *a))
    with pytest.raises(ValueError, match="xgrammar package is not installed"):
        make_engine_config()


def test_bucketing_strategy_flag_then_variables() -> None:
    assert parse([], {"VLLM_EXPONENTIAL_BUCKETING": "false"}).bucketing.strategy == "lin"
    assert parse([], {"VLLM_BUCKETING_STRATEGY": "LIN"}).bucketing.strategy == "lin"
    adaptive = parse(["--bucketing-strategy", "adaptive"], {"VLLM_BUCKETING_STRATEGY": "lin"})
    assert (adaptive.bucketing.strategy, adaptive.bucketing.adaptive) == ("exp", True)
    assert parse([], {"VLLM_PROMPT_BS_BUCKET_MAX": "4"}).bucketing.prompt_bs == (None, None, 4)
