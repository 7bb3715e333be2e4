"""`hpu-serve bench` end to end against the real server (tiny model)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow  # make test-fast skips it; make test (CI) runs it


def counter(base_url: str, name: str) -> float:
    text = httpx.get(base_url + "/metrics").text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name)


@pytest.fixture(scope="module")
def bench_server(tiny_model, start_server_fn, tiny_flags):
    srv = start_server_fn(tiny_model[0], *tiny_flags, env={"VLLM_API_KEY": "k3y"})
    yield srv
    srv.stop()


def bench(tiny_model, base_url: str, tmp_path, *extra: str) -> tuple[subprocess.CompletedProcess,
                                                                     dict]:
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, "-m", "server", "bench", "--base-url", base_url, "--tokenizer",
         tiny_model[0], "--num-prompts", "12", "--input-len", "24", "--output-len", "10",
         "--max-concurrency", "4", "--no-progress", "--result-file", str(out), *extra],
        capture_output=True, text=True, timeout=300, check=False,
    )
    return proc, (json.loads(out.read_text()) if out.exists() else {})


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_bench_reports_what_the_server_counted(tiny_model, bench_server, tmp_path,
                                                endpoint) -> None:
    url = bench_server.base_url
    before = counter(url, "vllm:generation_tokens_total")
    proc, result = bench(tiny_model, url, tmp_path, "--api-key", "k3y", "--endpoint", endpoint,
                         "--warmup-requests", "0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Output token throughput (tok/s):" in proc.stdout
    assert result["completed"] == 12
    assert result["failed"] == 0
    # ignore_eos: every request generates exactly output-len tokens, as the server counted
    assert result["output_tokens"] == 12 * 10
    assert counter(url, "vllm:generation_tokens_total") - before == 12 * 10
    assert result["per_request"]["output_tokens"] == [10] * 12
    assert result["model"] == "SmolLM2-135M-Instruct"  # discovered from /v1/models
    assert 0 < result["ttft_ms"]["p50"] <= result["e2e_ms"]["p50"]
    assert result["tpot_ms"]["mean"] > 0
    assert result["itl_ms"]["p99"] >= result["itl_ms"]["p50"]
    assert result["output_throughput"] == pytest.approx(120 / result["duration_s"])


def test_bench_counts_failures_and_exits_nonzero(tiny_model, bench_server, tmp_path) -> None:
    proc, result = bench(tiny_model, bench_server.base_url, tmp_path, "--model", "x",
                         "--warmup-requests", "0", "--api-key", "wrong")
    assert proc.returncode == 1
    assert result["completed"] == 0
    assert result["failed"] == 12
    assert any("HTTP 401" in e for e in result["errors"])


def test_multi_turn_conversations_resend_their_history(tiny_model, bench_server,
                                                       tmp_path) -> None:
    url = bench_server.base_url
    before = counter(url, "vllm:prompt_tokens_total")
    proc, result = bench(tiny_model, url, tmp_path, "--api-key", "k3y", "--endpoint", "chat",
                         "--turns", "3", "--warmup-requests", "0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert result["completed"] == 12 * 3
    lens = result["per_request"]["prompt_len"]
    # the server counted exactly the prompts the results report (usage.prompt_tokens)
    assert counter(url, "vllm:prompt_tokens_total") - before == sum(lens)
    for c in range(12):
        first, second, third = lens[3 * c: 3 * c + 3]
        # each turn carries the earlier turns and the 10-token answers to them
        assert first + 10 + 20 <= second and second + 10 + 20 <= third, lens[3 * c: 3 * c + 3]
    bad = subprocess.run([sys.executable, "-m", "server", "bench", "--base-url", url,
                          "--turns", "2"], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--turns needs --endpoint chat" in bad.stderr


def test_a_gguf_tokenizer_goes_to_the_servers_cache(smollm2_gguf, bench_server,
                                                   tmp_path) -> None:
    """The bench sizes prompts with a GGUF's tokenizer kept in the server's cache
    (HPU_SERVE_CACHE_DIR): converted once (~9 s for SmolLM2's vocabulary), then read back
    by later runs and by a server of that GGUF (tests/engine/test_tokenizer.py)."""
    folder, name = smollm2_gguf
    cache = tmp_path / "cache"
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, "-m", "server", "bench", "--base-url", bench_server.base_url,
         "--tokenizer", f"{folder}/{name}", "--num-prompts", "2", "--input-len", "8",
         "--output-len", "2", "--warmup-requests", "0", "--api-key", "k3y", "--no-progress",
         "--result-file", str(out)],
        capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "HPU_SERVE_CACHE_DIR": str(cache)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads(out.read_text())["completed"] == 2
    (entry,) = (cache / "tokenizers").iterdir()
    assert (entry / "tokenizer_config.json").exists()
