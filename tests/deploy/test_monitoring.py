"""Alert rules and the Grafana dashboard only name series a real server exposes: every
selector is parsed as PromQL and looked up in the /metrics of a live server (tiny model)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import promql_parser
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "config" / "prometheus" / "alerts.yaml"
DASHBOARD = ROOT / "config" / "grafana" / "hpu-serve-dashboard.json"
# written by Prometheus (per target) or attached from the target's labels, not by the server
PROMETHEUS_SERIES = {"up"}
TARGET_LABELS = {"namespace", "pod", "job", "instance", "le"}


def selectors(node: object) -> list[object]:
    """Every VectorSelector in a parsed PromQL expression."""
    if type(node).__name__ == "VectorSelector":
        return [node]
    found = []
    for attr in ("lhs", "rhs", "expr", "args", "param", "vector_selector"):
        child = getattr(node, attr, None)
        for c in child if isinstance(child, list) else [child] if child is not None else []:
            found += selectors(c)
    return found


@pytest.fixture(scope="module")
def exposed(tiny_model, start_server_fn, tiny_flags) -> dict[str, set[str]]:
    """sample name -> label names, from a live server's /metrics."""
    srv = start_server_fn(tiny_model[0], *tiny_flags)
    try:
        # one request, so the per-reason request counter has a series as in production
        httpx.post(srv.base_url + "/v1/completions", timeout=60,
                   json={"prompt": "hello", "max_tokens": 2}).raise_for_status()
        text = httpx.get(srv.base_url + "/metrics").text
    finally:
        srv.stop()
    names: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            names.setdefault(sample.name, set()).update(sample.labels)
    return names


def rules() -> list[dict]:
    return [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]


def dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    return exprs


def grafana_to_promql(expr: str) -> str:
    # Grafana substitutes its variables before Prometheus parses the query
    return (expr.replace("$__rate_interval", "5m").replace('"$model_name"', '".*"')
            .replace('"$pod"', '".*"'))


def check(expr: str, exposed: dict[str, set[str]]) -> list[str]:
    problems = []
    for sel in selectors(promql_parser.parse(expr)):
        if sel.name in PROMETHEUS_SERIES:
            continue
        if sel.name not in exposed:
            problems.append(f"{sel.name} is not in /metrics")
            continue
        for matcher in sel.matchers.matchers:
            if matcher.name not in exposed[sel.name] | TARGET_LABELS:
                problems.append(f"{sel.name} has no label {matcher.name}")
    return problems


def test_alert_rules_are_well_formed() -> None:
    names = set()
    for rule in rules():
        assert rule["alert"].startswith("HpuServe")
        assert rule["alert"] not in names
        names.add(rule["alert"])
        promql_parser.parse(rule["expr"])  # raises on a syntax error
        assert rule["labels"]["severity"] in ("info", "warning", "critical")
        assert rule["annotations"]["summary"]
    # the alerts the deployment guide promises
    assert {"HpuServeGraphCompilationWhileServing", "HpuServeBucketMissesRising",
            "HpuServeKVCacheNearlyFull", "HpuServeEngineDown"} <= names


def test_alert_rules_use_only_exposed_metrics(exposed) -> None:
    problems = [f"{r['alert']}: {p}" for r in rules() for p in check(r["expr"], exposed)]
    assert problems == []
    used = {s.name for r in rules() for s in selectors(promql_parser.parse(r["expr"]))}
    assert {"hpu_serve:graph_compilations_total", "hpu_serve:bucket_misses_total",
            "vllm:kv_cache_usage_perc", "hpu_serve:engine_up"} <= used


def test_dashboard_uses_only_exposed_metrics(exposed) -> None:
    exprs = dashboard_exprs()
    assert len(exprs) >= 10
    problems = [f"{e}: {p}" for e in exprs for p in check(grafana_to_promql(e), exposed)]
    assert problems == []


def test_checker_notices_a_wrong_name(exposed) -> None:
    assert check('rate(vllm:generation_tokens{model_name="x"}[5m])', exposed) == [
        "vllm:generation_tokens is not in /metrics"]  # the exposed name ends in _total
    assert check('hpu_serve:engine_up{gpu="0"}', exposed) == ["hpu_serve:engine_up has no label gpu"]
