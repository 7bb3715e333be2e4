import argparse

import pytest

from server.config import GiB, add_engine_args, engine_config_from_args, make_engine_config


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
