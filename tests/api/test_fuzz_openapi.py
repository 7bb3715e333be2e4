"""Property-based fuzzing of every route of the server's own OpenAPI document.

schemathesis generates requests from /openapi.json, valid ones and deliberately invalid
ones (a bounded number per operation and mode), sends them to a real server on loopback,
and checks each answer: never a 5xx, a status the document declares, the declared content
type, and a body that matches the declared schema. The engine must still be alive after.
The routes come from the app itself (built in-process at collection time), so a route added
later is fuzzed without touching this file; a guard test checks the served document holds
exactly the app's API routes, and the summary fails if any route got no case. The number of
cases per route is printed at the end of the run.
"""

from __future__ import annotations

import collections
import re
import time

import httpx
import pytest
import schemathesis
from fake_engine import FakeEngine
from fastapi.routing import APIRoute
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from server_process import TINY_FLAGS, start_server

from server.api.app import build_app
from server.config import ServerConfig

pytestmark = pytest.mark.slow  # make test-fast skips it; make test (CI) runs it

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


def served_routes() -> tuple[list[str], list[str]]:
    """(API routes, the documentation's own routes) of the app, as schemathesis labels them:
    "METHOD /path". HEAD is GET without a body: not a route of its own."""
    api, docs = [], []
    for route in build_app(FakeEngine(), ServerConfig()).routes:
        for method in sorted(getattr(route, "methods", None) or ()):
            if method != "HEAD":
                documented = isinstance(route, APIRoute) and route.include_in_schema
                # the document writes {id} for a Starlette {id:path} parameter
                path = re.sub(r"\{(\w+):\w+\}", r"{\1}", route.path)
                (api if documented else docs).append(f"{method} {path}")
    return api, docs


# Every route the app serves: the documented ones are fuzzed against their schema, the
# documentation's own (/openapi.json, /docs...) get one plain request each.
ROUTES, DOC_ROUTES = served_routes()
CASES: collections.Counter[str] = collections.Counter()
STATUSES: dict[str, collections.Counter[int]] = collections.defaultdict(collections.Counter)
SECONDS: collections.Counter[str] = collections.Counter()


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    return schemathesis.openapi.from_url(fuzz_server.base_url + "/openapi.json")


def test_the_route_list_is_the_document(api_schema) -> None:
    assert len(ROUTES) >= 10  # derived, not hand-kept: the /v1 API and the admin routes
    assert sorted(r.ok().label for r in api_schema.get_all_operations()) == sorted(ROUTES)
    # An undocumented route would escape the schema fuzzing: only FastAPI's own docs may be
    assert {label.split(" ", 1)[1] for label in DOC_ROUTES} <= {
        "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}, DOC_ROUTES


@pytest.mark.parametrize("label", DOC_ROUTES)
def test_documentation_route(fuzz_server, label: str) -> None:
    method, path = label.split(" ", 1)
    started = time.monotonic()
    response = httpx.request(method, fuzz_server.base_url + path, timeout=60)
    CASES[label] += 1
    STATUSES[label][response.status_code] += 1
    SECONDS[label] = time.monotonic() - started
    assert response.status_code == 200


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
            response = case.call(timeout=60)
            STATUSES[label][response.status_code] += 1  # counted even when a check fails
            case.validate_response(response, checks=CHECKS)

        check()
    SECONDS[label] = time.monotonic() - started
    assert httpx.get(fuzz_server.base_url + "/health", timeout=10).status_code == 200


def test_the_engine_is_alive_after_fuzzing(fuzz_server, capsys) -> None:
    with capsys.disabled():
        print()
        for label in ROUTES + DOC_ROUTES:
            statuses = ", ".join(f"{k}: {v}" for k, v in sorted(STATUSES[label].items()))
            print(f"schemathesis cases {label}: {CASES[label]} ({statuses}) "
                  f"in {SECONDS[label]:.1f} s")
        server_errors = sum(n for c in STATUSES.values() for status, n in c.items()
                            if status >= 500)
        print(f"schemathesis cases in all: {sum(CASES.values())}, "
              f"{server_errors} answers >= 500")
    assert server_errors == 0
    skipped = [label for label in ROUTES + DOC_ROUTES if CASES[label] < 1]
    assert not skipped, f"routes never fuzzed: {skipped}"
    assert httpx.get(fuzz_server.base_url + "/health", timeout=10).status_code == 200
    assert fuzz_server.proc.poll() is None
