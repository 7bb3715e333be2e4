"""/score under each of vLLM's spellings of its two sides (queries / documents, queries /
items, data_1 / data_2, text_1 / text_2), through the real server, against
sentence-transformers' CrossEncoder on the same weights; and the 400s for a missing or mixed
pair."""

from __future__ import annotations

import httpx
import pytest

from tests.server_process import start_server

pytestmark = pytest.mark.slow

QUERY = "quick fox"
DOCS = ["the quick brown fox", "numbers 0 1 2 3", "paged attention stores keys"]


@pytest.fixture(scope="module")
def scorer(cross_encoder):
    folder = cross_encoder("xlm-roberta")  # the shape of vLLM's rerankers (bge-reranker-v2-m3)
    server = start_server(folder, "--served-model-name", "rr", "--dtype", "float32")
    yield server, folder
    server.stop()


@pytest.mark.parametrize("first,second", [("queries", "documents"), ("queries", "items"),
                                          ("data_1", "data_2"), ("text_1", "text_2")])
def test_each_spelling_scores_the_same_pairs(scorer, first: str, second: str) -> None:
    from sentence_transformers import CrossEncoder

    server, folder = scorer
    ref = CrossEncoder(folder, device="cpu").predict([(QUERY, d) for d in DOCS])
    for path in ("/score", "/v1/score"):
        answer = httpx.post(server.base_url + path,
                            json={"model": "rr", first: QUERY, second: DOCS})
        assert answer.status_code == 200, answer.text
        assert [d["score"] for d in answer.json()["data"]] == pytest.approx(
            list(map(float, ref)), abs=1e-4)
    pairwise = httpx.post(server.base_url + "/score",
                          json={first: [QUERY, "numbers"], second: DOCS[:2]}).json()
    assert len(pairwise["data"]) == 2
    assert pairwise["data"][0]["score"] == pytest.approx(float(ref[0]), abs=1e-4)


@pytest.mark.parametrize("body,param", [
    ({"queries": QUERY}, "documents"),            # half a pair: the partner it lacks
    ({"documents": DOCS}, "queries"),
    ({"queries": QUERY, "text_2": DOCS}, "text_2"),  # two spellings mixed: ambiguous
    ({"queries": QUERY, "documents": DOCS, "items": DOCS}, "items"),
    ({}, "queries"),
])
def test_missing_or_mixed_sides_are_a_400_naming_the_field(scorer, body: dict,
                                                           param: str) -> None:
    server, _ = scorer
    answer = httpx.post(server.base_url + "/score", json=body)
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == param
    assert "queries and documents" in answer.json()["error"]["message"]


def test_length_mismatch_names_the_fields_the_client_sent(scorer) -> None:
    server, _ = scorer
    answer = httpx.post(server.base_url + "/score",
                        json={"queries": ["a", "b"], "documents": ["c", "d", "e"]})
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == "documents" and "queries has 2 items" in error["message"]
