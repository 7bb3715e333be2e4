"""Property-based fuzzing of every route of the server's own OpenAPI document.

schemathesis generates requests from /openapi.json, valid ones and deliberately invalid
ones (a bounded number per operation and mode), sends them to a real server on loopback,
and checks each answer: never a 5xx, a status the document declares, the declared content
type, and a body that matches the declared schema. The engine must still be alive after.
The number of cases per route is printed at the end of the run.
"""

from __future__ import annotations

import collections
import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from server_process import TINY_FLAGS, start_server

# Cases per operation with a body and generation mode (positive, negative): ~1600 in all,
# ~30 s on 2 cores (a route without parameters has one possible request).
EXAMPLES = 200
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance]


@pytest.fixture(scope="module")
def fuzz_server(tiny_model):
    # Generation bounded per request, so valid cases stay cheap: a short context and few
    # tokens per request (beyond them: a clear 400, itself part of what is checked).
    # One OpenMP thread: the tiny model gains nothing from two, and with the CPUs shared
    # (another test run, a benchmark) spinning OpenMP teams made its steps ~80x slower.
    srv = start_server(tiny_model[0], *TINY_FLAGS, "--max-model-len", "64",
                       "--max-tokens-per-request", "128", env={"OMP_NUM_THREADS": "1"})
    yield srv
    srv.stop()


# Every route of the document, as schemathesis labels them (a guard test keeps this in step
# with /openapi.json, so a new route cannot go unfuzzed).
ROUTES = ["POST /v1/chat/completions", "POST /v1/completions", "GET /v1/models", "GET /health",
          "POST /reset_prefix_cache", "GET /buckets/observed",
          "GET /version", "GET /metrics", "POST /tokenize", "POST /detokenize"]
CASES: collections.Counter[str] = collections.Counter()
STATUSES: dict[str, collections.Counter[int]] = collections.defaultdict(collections.Counter)
SECONDS: collections.Counter[str] = collections.Counter()


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    return schemathesis.openapi.from_url(fuzz_server.base_url + "/openapi.json")


def test_the_route_list_is_the_document(api_schema) -> None:
    assert sorted(r.ok().label for r in api_schema.get_all_operations()) == sorted(ROUTES)


@pytest.mark.parametrize("label", ROUTES)
def test_route_against_its_schema(fuzz_server, api_schema, label: str) -> None:
    operation = api_schema.find_operation_by_label(label)
    assert operation is not None
    started = time.monotonic()
    # A route without parameters or body has one valid request and no invalid one.
    modes = [GenerationMode.POSITIVE, GenerationMode.NEGATIVE] if operation.body else \
        [GenerationMode.POSITIVE]
    for mode in modes:

        @given(operation.as_strategy(generation_mode=mode))
        @settings(max_examples=EXAMPLES, deadline=None, database=None,
                  phases=[Phase.explicit, Phase.generate],
                  suppress_health_check=list(HealthCheck))
        def check(case) -> None:
            CASES[label] += 1
            response = case.call_and_validate(checks=CHECKS, timeout=60)
            STATUSES[label][response.status_code] += 1

        check()
    SECONDS[label] = time.monotonic() - started
    assert httpx.get(fuzz_server.base_url + "/health", timeout=10).status_code == 200


def test_the_engine_is_alive_after_fuzzing(fuzz_server, capsys) -> None:
    with capsys.disabled():
        print()
        for label in ROUTES:
            statuses = ", ".join(f"{k}: {v}" for k, v in sorted(STATUSES[label].items()))
            print(f"schemathesis cases {label}: {CASES[label]} ({statuses}) "
                  f"in {SECONDS[label]:.1f} s")
        server_errors = sum(n for c in STATUSES.values() for status, n in c.items()
                            if status >= 500)
        print(f"schemathesis cases in all: {sum(CASES.values())}, "
              f"{server_errors} answers >= 500")
    assert server_errors == 0
    assert all(CASES[label] >= 1 for label in ROUTES), CASES
    assert httpx.get(fuzz_server.base_url + "/health", timeout=10).status_code == 200
    assert fuzz_server.proc.poll() is None
