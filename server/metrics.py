"""Prometheus metrics with vLLM's standard names, in a registry per server.

Engine-derived gauges are read at scrape time by a collector; request-level counters and
histograms are recorded by the API as outputs flow. Other layers (the device layer's
graph-compile and bucket-miss counters) register into the same ``registry``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

# vLLM's bucket boundaries, so dashboards built for vLLM read the same.
disable_created_metrics()  # vLLM exposes no *_created series

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)
_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                30.0)


class EngineCollector(Collector):
    """Scheduler and KV cache state, read from ``stats()`` whenever Prometheus scrapes."""

    def __init__(self, stats: Callable[[], Any], model_name: str,
                 alive: Callable[[], bool] = lambda: True) -> None:
        self._stats = stats
        self._model = model_name
        self._alive = alive

    def collect(self) -> Iterator[Any]:
        labels = ["model_name"]
        # /health turns 503 when the engine loop dies; this is the same fact for alert rules
        up = GaugeMetricFamily("hpu_serve:engine_up", "1 while the engine loop runs, 0 once "
                               "it died (the server then answers 503).", labels=labels)
        up.add_metric([self._model], 1.0 if self._alive() else 0.0)
        yield up
        s = self._stats()
        for name, doc, value in (
            ("vllm:num_requests_running", "Requests in the running batch.", s.num_running),
            ("vllm:num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting),
            ("vllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).",
             s.kv_cache_usage),
        ):
            gauge = GaugeMetricFamily(name, doc, labels=labels)
            gauge.add_metric([self._model], value)
            yield gauge
        # vLLM splits the waiting into those short of KV blocks or batch room ("capacity")
        # and those its scheduler holds back by policy ("deferred"); this scheduler holds none
        # back: a request's grammar is compiled before it is queued
        by_reason = GaugeMetricFamily("vllm:num_requests_waiting_by_reason",
                                      "Requests waiting to be scheduled, by why they wait.",
                                      labels=[*labels, "reason"])
        by_reason.add_metric([self._model, "capacity"], s.num_waiting)
        by_reason.add_metric([self._model, "deferred"], 0)
        yield by_reason
        # vLLM's one-hot sleep gauge: awake, or asleep at level 1 (weights offloaded) or 2
        # (weights and KV cache discarded); a partial wake still reads as the sleep
        level = getattr(s, "sleep_level", 0)
        sleep = GaugeMetricFamily("vllm:engine_sleep_state", "Engine sleep state: 1 on the "
                                  "state the engine is in.", labels=[*labels, "sleep_state"])
        for state, value in (("awake", level == 0), ("weights_offloaded", level == 1),
                             ("discard_all", level == 2)):
            sleep.add_metric([self._model, state], float(value))
        yield sleep
        for name, doc, value in (
            ("vllm:num_preemptions", "Preemptions by recompute.", s.num_preemptions),
            ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
             getattr(s, "prefix_cache_queries", 0)),
            ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
             getattr(s, "prefix_cache_hits", 0)),
        ):
            counter = CounterMetricFamily(name, doc, labels=labels)
            counter.add_metric([self._model], value)
            yield counter
        per_pos = getattr(s, "spec_accepted_per_pos", ())
        if per_pos:  # --speculative-config: vLLM's acceptance counters
            for name, doc, value in (
                ("vllm:spec_decode_num_drafts", "Draft runs verified (one per sequence "
                 "per verify step).", s.spec_num_drafts),
                ("vllm:spec_decode_num_draft_tokens", "Draft tokens verified.",
                 s.spec_num_draft_tokens),
                ("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                 s.spec_num_accepted_tokens),
            ):
                counter = CounterMetricFamily(name, doc, labels=labels)
                counter.add_metric([self._model], value)
                yield counter
            counter = CounterMetricFamily(
                "vllm:spec_decode_num_accepted_tokens_per_pos",
                "Draft tokens accepted at each position of the draft.",
                labels=labels + ["position"])
            for pos, value in enumerate(per_pos):
                counter.add_metric([self._model, str(pos)], value)
            yield counter
        max_lora = getattr(s, "max_lora", 0)
        if max_lora:  # --enable-lora: vLLM's info gauge (the value: when it was read)
            info = GaugeMetricFamily(
                "vllm:lora_requests_info", "Running stats on lora requests.",
                labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
            info.add_metric([str(max_lora), ",".join(s.waiting_lora_adapters),
                             ",".join(s.running_lora_adapters)], time.time())
            yield info


class ServerMetrics:
    """The request-level series; one instance per app, in its own registry."""

    def __init__(self, model_name: str, stats: Callable[[], Any],
                 registry: CollectorRegistry | None = None,
                 alive: Callable[[], bool] = lambda: True) -> None:
        self.registry = registry or CollectorRegistry()
        self.model_name = model_name
        self.registry.register(EngineCollector(stats, model_name, alive))
        r, m = self.registry, ["model_name"]
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens processed.", m,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.", m,
                                         registry=r).labels(model_name)
        self.request_success = Counter("vllm:request_success", "Finished requests.",
                                       m + ["finished_reason"], registry=r)
        self.ttft = self._hist("vllm:time_to_first_token_seconds", "Time to first token.",
                               _TTFT_BUCKETS)
        self.itl = self._hist("vllm:inter_token_latency_seconds", "Time between tokens.",
                              _ITL_BUCKETS)
        self.e2e = self._hist("vllm:e2e_request_latency_seconds", "End-to-end latency.")
        self.queue_time = self._hist("vllm:request_queue_time_seconds", "Time waiting.")
        self.prefill_time = self._hist("vllm:request_prefill_time_seconds", "Prefill phase.")
        self.decode_time = self._hist("vllm:request_decode_time_seconds", "Decode phase.")
        self.inference_time = self._hist("vllm:request_inference_time_seconds",
                                         "Prefill and decode: first scheduled to finished.")
        self.request_prompt_tokens = self._hist(
            "vllm:request_prompt_tokens", "Prompt tokens per request.", _TOKEN_BUCKETS)
        self.request_generation_tokens = self._hist(
            "vllm:request_generation_tokens", "Generated tokens per request.", _TOKEN_BUCKETS)
        self.request_params_n = self._hist("vllm:request_params_n", "The n parameter.",
                                           (1, 2, 5, 10, 20))
        self.request_params_max_tokens = self._hist(
            "vllm:request_params_max_tokens", "The max_tokens parameter.", _TOKEN_BUCKETS)

        # hpu_serve's own: how late the event loop wakes (a probe sleeps 0.1 s, again and
        # again); a loop held by one request's work delays every other client
        self.loop_lag = self._hist("hpu_serve:event_loop_lag_seconds",
                                   "How late the event loop woke from a 0.1 s sleep.",
                                   _LAG_BUCKETS)
        self.loop_lag_last = Gauge("hpu_serve:event_loop_lag_last_seconds",
                                   "The event loop's lag at the latest probe.", m,
                                   registry=r).labels(model_name)

    def observe_loop_lag(self, seconds: float) -> None:
        self.loop_lag.observe(seconds)
        self.loop_lag_last.set(seconds)

    def _hist(self, name: str, doc: str, buckets: tuple = _REQUEST_BUCKETS) -> Any:
        return Histogram(name, doc, ["model_name"], buckets=buckets,
                         registry=self.registry).labels(self.model_name)

    def record_finished(self, output: Any, n: int, max_tokens: int | None) -> None:
        """Per-request series once the last output of a request has arrived."""
        m = output.metrics
        for completion in output.outputs:
            self.request_success.labels(self.model_name, completion.finish_reason or "abort").inc()
        self.request_prompt_tokens.observe(len(output.prompt_token_ids))
        self.request_generation_tokens.observe(output.num_generated_tokens)
        self.request_params_n.observe(n)
        if max_tokens is not None:
            self.request_params_max_tokens.observe(max_tokens)
        if m is None or m.finished_time is None:
            return
        self.e2e.observe(m.finished_time - m.arrival_time)
        if m.first_scheduled_time is not None:
            self.queue_time.observe(m.first_scheduled_time - m.arrival_time)
            self.inference_time.observe(m.finished_time - m.first_scheduled_time)
            if m.first_token_time is not None:
                self.prefill_time.observe(m.first_token_time - m.first_scheduled_time)
                self.decode_time.observe(m.finished_time - m.first_token_time)
