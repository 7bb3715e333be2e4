"""Platforms are entry-point plugins; a third party adds one by installing a package."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from server.hpu.platform import detect_platform, discover_platforms

PLUGIN = '''
import torch
from server.hpu.platform import Platform

class TpuPlatform(Platform):
    name = "tpu"

def plugin():
    return TpuPlatform(torch.device("cpu"))

def unavailable():
    return None
'''


@pytest.fixture()
def fake_plugin_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An installed-looking distribution registering two platforms (one unavailable)."""
    (tmp_path / "fake_tpu_plugin.py").write_text(PLUGIN)
    dist = tmp_path / "fake_tpu-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-tpu\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[hpu_serve.platform_plugins]\ntpu = fake_tpu_plugin:plugin\n"
        "neuron = fake_tpu_plugin:unavailable\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_builtins_register_through_entry_points() -> None:
    found = discover_platforms()
    assert {"hpu", "cuda", "cpu"} <= found.keys()
    assert found["cpu"] is not None
    assert detect_platform("cpu").name == "cpu"


def test_third_party_platform_is_discovered_and_preferred_over_cpu(fake_plugin_dir) -> None:
    found = discover_platforms()
    assert found["tpu"] is not None
    assert found["neuron"] is None
    assert detect_platform("auto").name == "tpu"  # no HPU or CUDA here
    with pytest.raises(RuntimeError, match="neuron"):
        detect_platform("neuron")


def test_cli_lists_platforms_and_prints_bucket_plans(fake_plugin_dir) -> None:
    cli = [sys.executable, "-m", "server"]
    env = dict(os.environ, PYTHONPATH=str(fake_plugin_dir))
    out = subprocess.run(cli + ["platforms"], capture_output=True, text=True, env=env)
    assert out.returncode == 0
    assert "tpu      available" in out.stdout
    assert "selected: tpu" in out.stdout
    plain = ["--no-enable-chunked-prefill", "--no-enable-prefix-caching"]
    out = subprocess.run(cli + ["buckets", "--max-model-len", "1024", "--max-num-seqs", "4",
                                "--max-num-batched-tokens", "1024", *plain],
                         capture_output=True, text=True, env=dict(env, VLLM_SKIP_WARMUP="1"))
    assert out.returncode == 0
    assert "Generated 7 prompt buckets" in out.stdout
    assert "Generated 13 decode buckets" in out.stdout
    lin = dict(env, VLLM_BUCKETING_STRATEGY="lin", VLLM_PROMPT_SEQ_BUCKET_MAX="512")
    out = subprocess.run(cli + ["buckets", "--max-model-len", "1024", *plain],
                         capture_output=True, text=True, env=lin)
    assert "Generated 4 prompt buckets" in out.stdout
    # the defaults (chunked prefill, prefix caching) add batch-1 buckets with context:
    # (1024 - 128) / 128 = 7 context blocks at most, every one with the linear strategy
    out = subprocess.run(cli + ["buckets", "--max-model-len", "1024"], capture_output=True,
                         text=True, env=lin)
    assert "ctx:[0, 1, 7, 0]" in out.stdout
    assert "Generated 32 prompt buckets" in out.stdout


def test_builtin_fallback_names_the_entry_points_of_pyproject() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    from server.hpu.platform import BUILTIN_PLUGINS, PLUGIN_GROUP

    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    declared = tomllib.loads(pyproject.read_text())["project"]["entry-points"][PLUGIN_GROUP]
    assert declared == BUILTIN_PLUGINS
