"""vLLM's request and step series that its own test_metrics.py expects (found missing by
that test): vllm:iteration_tokens_total, vllm:request_inference_time_seconds and
vllm:num_requests_waiting_by_reason, with the values vLLM's test derives."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families


def samples(server) -> dict[str, float]:
    text = httpx.get(server.base_url + "/metrics").text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name + "".join(f"|{k}={v}" for k, v in sorted(s.labels.items())
                                   if k != "model_name")
            out[key] = s.value
    return out


def test_step_and_request_series_count_as_vllm_counts(server) -> None:
    prompt = [5, 6, 7, 8, 9, 10, 11]  # token ids: the prompt length is exact
    requests, max_tokens = 3, 5
    before = samples(server)
    for _ in range(requests):  # one at a time: every step belongs to one request
        resp = httpx.post(server.base_url + "/v1/completions", timeout=120, json={
            "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True})
        assert resp.status_code == 200, resp.text
    after = samples(server)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    # a prefill step (the whole prompt + its first token), then one step per further token
    assert delta("vllm:iteration_tokens_total_count") == requests * max_tokens
    assert delta("vllm:iteration_tokens_total_sum") == requests * (len(prompt) + max_tokens)
    assert delta("vllm:request_inference_time_seconds_count") == requests
    assert delta("vllm:request_inference_time_seconds_sum") > 0
    assert after["vllm:num_requests_waiting_by_reason|reason=capacity"] == 0
    assert after["vllm:num_requests_waiting_by_reason|reason=deferred"] == 0
