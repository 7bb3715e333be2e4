"""A dead engine loop shows in /health (503) and in /metrics (hpu_serve:engine_up 0), which
the EngineDown alert rule reads."""

from __future__ import annotations

from fake_engine import FakeEngine
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from server.api.app import build_app
from server.config import ServerConfig


def engine_up(client: TestClient) -> float:
    text = client.get("/metrics").text
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "hpu_serve:engine_up"]
    assert len(samples) == 1
    assert samples[0].labels == {"model_name": "fake-model"}
    return samples[0].value


def test_engine_death_turns_health_503_and_engine_up_0() -> None:
    engine = FakeEngine()
    app = build_app(engine, ServerConfig())
    with TestClient(app) as client:
        assert client.get("/health").status_code == 200
        assert engine_up(client) == 1.0
        engine.is_alive = False
        resp = client.get("/health")
        assert resp.status_code == 503
        assert "engine" in resp.json()["error"]["message"]
        assert engine_up(client) == 0.0
