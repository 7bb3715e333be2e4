"""Pooling through the real HTTP server and the official openai SDK."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest

from tests.server_process import start_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def embed_server(st_folder):
    folder = st_folder("bert", "mean", True)
    server = start_server(folder, "--max-num-seqs", "4", "--served-model-name", "emb")
    yield server, folder
    server.stop()


@pytest.fixture(scope="module")
def rerank_server(cross_encoder):
    server = start_server(cross_encoder("bert"), "--served-model-name", "rr", "--dtype",
                          "float32")
    yield server
    server.stop()


def test_embeddings_float_and_base64(embed_server) -> None:
    from sentence_transformers import SentenceTransformer

    server, folder = embed_server
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x")
    texts = ["the quick brown fox", "paged attention stores keys and values", "café"]
    floats = client.embeddings.create(model="emb", input=texts)
    b64 = client.embeddings.create(model="emb", input=texts, encoding_format="base64")
    got = np.array([d.embedding for d in floats.data])
    # asked for explicitly, base64 comes back as sent: float32 little-endian bytes
    decoded = [np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in b64.data]
    assert np.allclose(np.array(decoded), got, atol=1e-6)
    ref = SentenceTransformer(folder, device="cpu").encode(texts)
    cos = (got * ref).sum(-1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(ref, axis=-1)
    assert cos.min() >= 0.9999  # the float32 checkpoint runs in float32
    assert floats.usage.prompt_tokens > 0 and floats.model == "emb"
    ids = client.embeddings.create(model="emb", input=[[5, 6, 7]])  # token ids
    assert len(ids.data[0].embedding) == 64


def test_embedding_errors(embed_server) -> None:
    server, _ = embed_server
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x")
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        client.embeddings.create(model="emb", input="hi", dimensions=8)
    with pytest.raises(openai.BadRequestError, match="input"):
        client.embeddings.create(model="emb", input=[])
    with pytest.raises(openai.BadRequestError, match="input"):
        client.embeddings.create(model="emb", input="")
    with pytest.raises(openai.BadRequestError, match="--runner"):
        client.chat.completions.create(model="emb", messages=[{"role": "user",
                                                               "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="--runner"):
        client.completions.create(model="emb", prompt="hi")
    # the server is still fine afterwards
    assert len(client.embeddings.create(model="emb", input="hi").data) == 1


def test_rerank_and_score(rerank_server, cross_encoder) -> None:
    from sentence_transformers import CrossEncoder

    query = "quick fox"
    docs = ["the quick brown fox", "numbers 0 1 2 3", "paged attention stores keys", "café"]
    ref = CrossEncoder(cross_encoder("bert"), device="cpu").predict([(query, d) for d in docs])
    order = sorted(range(len(docs)), key=lambda i: -ref[i])
    url = rerank_server.base_url
    answer = httpx.post(url + "/rerank", json={"query": query, "documents": docs,
                                               "top_n": 2}).json()
    assert [r["index"] for r in answer["results"]] == order[:2]
    assert answer["results"][0]["document"]["text"] == docs[order[0]]
    assert answer["results"][0]["relevance_score"] == pytest.approx(float(ref[order[0]]),
                                                                    abs=1e-4)
    v1 = httpx.post(url + "/v1/rerank", json={"query": query, "documents": docs,
                                              "return_documents": False}).json()
    assert len(v1["results"]) == 4 and "document" not in v1["results"][0]
    score = httpx.post(url + "/score", json={"text_1": query, "text_2": docs}).json()
    assert [d["score"] for d in score["data"]] == pytest.approx(list(map(float, ref)),
                                                                abs=1e-4)
    bad = httpx.post(url + "/score", json={"text_1": ["a", "b"], "text_2": ["c", "d", "e"]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "text_2"


def test_pooling_endpoint_on_generative_server(tiny_model) -> None:
    server = start_server(tiny_model[0], "--max-model-len", "128")
    try:
        answer = httpx.post(server.base_url + "/v1/embeddings", json={"input": "hi"})
        assert answer.status_code == 400 and "--runner" in answer.json()["error"]["message"]
        rerank = httpx.post(server.base_url + "/rerank", json={"query": "a",
                                                               "documents": ["b"]})
        assert rerank.status_code == 400 and "--runner" in rerank.json()["error"]["message"]
    finally:
        server.stop()
