"""``hpu-serve serve --device hpu`` end to end on the bridge stand-in, with the Gaudi image's
environment: warmup before the port opens, the reference's log lines and counters, zero
compilations while serving, and the bridge configured as the image configures it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
from server_process import MODEL_NAME, STANDIN_SERVER, TINY_FLAGS, start_server

ROOT = Path(__file__).resolve().parents[2]


def image_environment() -> dict[str, str]:
    """The ENV of deploy/docker/Dockerfile.hpu that the bridge and the server read."""
    text = (ROOT / "deploy" / "docker" / "Dockerfile.hpu").read_text()
    block = re.search(r"^ENV PYTHONUNBUFFERED=1(.*?)^USER", text, re.S | re.M)
    assert block is not None, "the image's ENV block moved"
    pairs = dict(re.findall(r"(\w+)=(\S+)", block.group(0)))
    return {k: v for k, v in pairs.items() if k.startswith(("PT_HPU_", "HABANA_", "VLLM_"))}


def counter(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} {labels}")


def test_serve_on_hpu_with_the_image_environment(tiny_model, tmp_path: Path) -> None:
    image_env = image_environment()
    assert image_env["PT_HPU_LAZY_MODE"] == "1"
    buckets = tmp_path / "buckets.txt"
    buckets.write_text("(1, [16, 32, 64], 0)\n([1, 2, 4], 1, [4, 8, 16])\n")
    record = tmp_path / "bridge-calls.json"
    env = {**image_env, "VLLM_BUCKETING_FROM_FILE": str(buckets),
           "HABANA_STANDIN_RECORD": str(record)}
    # the prompts share prefixes; this bucket file has no context-block buckets for the
    # cache hits to run in (tests/hpu/test_compiled_context.py covers those)
    srv = start_server(tiny_model[0], *TINY_FLAGS, "--device", "hpu", "--max-num-seqs", "4",
                       "--max-model-len", "128", "--no-enable-prefix-caching", env=env,
                       script=STANDIN_SERVER)
    try:
        for i in range(6):
            resp = httpx.post(srv.base_url + "/v1/completions", timeout=60, json={
                "model": MODEL_NAME, "prompt": "numbers " * (1 + 3 * i), "max_tokens": 5 + i,
                "temperature": 0, "ignore_eos": True})
            assert resp.status_code == 200, resp.text
        metrics = httpx.get(srv.base_url + "/metrics").text
    finally:
        assert srv.stop() == 0
    log = srv.log()
    assert "Execution mode: HPU graphs" in log
    assert "[Warmup][Prompt][1/3] batch_size:1 seq_len:64" in log
    assert "Graph/Prompt captured:3 (100.0%)" in log
    assert "Graph/Decode captured:8 (100.0%)" in log  # (1, 1, 16) is capped to (1, 1, 8)
    for phase, planned in (("prefill", 3), ("decode", 8)):
        for state in ("planned", "captured"):
            assert counter(metrics, "hpu_serve:warmup_buckets", phase=phase, state=state) \
                == planned
        assert counter(metrics, "hpu_serve:graph_compilations_total", phase=phase,
                       stage="serving") == 0
        assert counter(metrics, "hpu_serve:graph_compilations_total", phase=phase,
                       stage="warmup") == 2 * planned  # a recipe and a graph per bucket
    calls = json.loads(record.read_text())["calls"]
    names = [c["name"] for c in calls]
    for name in ("hpu.is_available", "hpu.mem_get_info", "hpu.wrap_in_hpu_graph",
                 "hpu_graph.capture", "hpu_graph.replay", "core.mark_step"):
        assert name in names, name
    load = next(c for c in calls if c["name"] == "bridge.load")["arguments"]
    assert load["PT_HPU_LAZY_MODE"] == "1"
    assert load["PT_HPU_RECIPE_CACHE_CONFIG"] == image_env["PT_HPU_RECIPE_CACHE_CONFIG"]
