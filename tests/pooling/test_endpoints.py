"""The pooling endpoints beyond embeddings / rerank / score basics, through the real server:
/classify against transformers, /pooling, chat-style ``messages``, Matryoshka ``dimensions``
against sentence-transformers, ``encoding_format``, over-long inputs, and unknown fields."""

from __future__ import annotations

import base64
import json
import shutil

import httpx
import numpy as np
import openai
import pytest

from tests.pooling.conftest import save_hf
from tests.server_process import start_server

pytestmark = pytest.mark.slow

TEXTS = ["the quick brown fox", "paged attention stores keys and values", "café"]
TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}[assistant]{% endif %}")
DIMS = [16, 32, 64]


@pytest.fixture(scope="module")
def matryoshka_server(st_folder, tmp_path_factory):
    """A sentence-transformers BERT folder whose config names matryoshka_dimensions."""
    folder = tmp_path_factory.mktemp("matryoshka") / "st"
    shutil.copytree(st_folder("bert", "mean", True), folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["matryoshka_dimensions"] = DIMS
    (folder / "config.json").write_text(json.dumps(cfg))
    template = folder.parent / "template.jinja"
    template.write_text(TEMPLATE)
    server = start_server(str(folder), "--served-model-name", "emb", "--dtype", "float32",
                          "--chat-template", str(template))
    yield server, str(folder)
    server.stop()


@pytest.fixture(scope="module")
def classify_server(tmp_path_factory):
    """A three-label BertForSequenceClassification with named labels."""
    folder = tmp_path_factory.mktemp("classifier")
    save_hf(folder, "bert", classify=True, num_labels=3, seed=2)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["id2label"] = {"0": "neg", "1": "neutral", "2": "pos"}
    cfg["label2id"] = {"neg": 0, "neutral": 1, "pos": 2}
    (folder / "config.json").write_text(json.dumps(cfg))
    server = start_server(str(folder), "--served-model-name", "cls", "--dtype", "float32")
    yield server, str(folder)
    server.stop()


def test_classify_equals_transformers(classify_server) -> None:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    server, folder = classify_server
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    with torch.no_grad():
        logits = torch.cat([model(**tok(t, return_tensors="pt")).logits for t in TEXTS])
    probs = torch.softmax(logits, -1)
    answer = httpx.post(server.base_url + "/classify", json={"model": "cls", "input": TEXTS})
    assert answer.status_code == 200, answer.text
    data = answer.json()["data"]
    assert [d["index"] for d in data] == [0, 1, 2]
    got = np.array([d["probs"] for d in data])
    assert np.allclose(got, probs.numpy(), atol=1e-5)
    names = ["neg", "neutral", "pos"]
    assert [d["label"] for d in data] == [names[int(i)] for i in probs.argmax(-1)]
    assert all(d["num_classes"] == 3 for d in data)
    assert answer.json()["usage"]["prompt_tokens"] == sum(len(tok(t)["input_ids"])
                                                          for t in TEXTS)
    # use_activation false: the head's raw logits
    raw = httpx.post(server.base_url + "/classify", json={"input": TEXTS[0],
                                                          "use_activation": False}).json()
    assert np.allclose(raw["data"][0]["probs"], logits[0].numpy(), atol=1e-4)
    # /pooling on a classifier gives the same probabilities
    pooled = httpx.post(server.base_url + "/pooling", json={"input": TEXTS}).json()
    assert np.allclose([d["data"] for d in pooled["data"]], got, atol=1e-6)
    # and it is no embedder
    emb = httpx.post(server.base_url + "/v1/embeddings", json={"input": "hi"})
    assert emb.status_code == 400 and "/classify" in emb.json()["error"]["message"]


def test_pooling_endpoint_equals_embeddings(matryoshka_server) -> None:
    server, _ = matryoshka_server
    url = server.base_url
    emb = httpx.post(url + "/v1/embeddings", json={"input": TEXTS}).json()
    pooled = httpx.post(url + "/pooling", json={"input": TEXTS}).json()
    assert pooled["object"] == "list" and pooled["data"][0]["object"] == "pooling"
    assert np.allclose([d["data"] for d in pooled["data"]],
                       [d["embedding"] for d in emb["data"]], atol=1e-6)
    b64 = httpx.post(url + "/pooling", json={"input": TEXTS[0],
                                             "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(b64["data"][0]["data"]), dtype="<f4")
    assert np.allclose(decoded, emb["data"][0]["embedding"], atol=1e-7)


def test_chat_messages_render_the_template(matryoshka_server) -> None:
    from transformers import AutoTokenizer

    server, folder = matryoshka_server
    messages = [{"role": "system", "content": "answer briefly"},
                {"role": "user", "content": "the quick brown fox"}]
    tok = AutoTokenizer.from_pretrained(folder)
    text = tok.apply_chat_template(messages, chat_template=TEMPLATE, tokenize=False,
                                   add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    url = server.base_url
    chat = httpx.post(url + "/v1/embeddings", json={"messages": messages,
                                                    "add_generation_prompt": True}).json()
    plain = httpx.post(url + "/v1/embeddings", json={"input": [ids]}).json()
    assert chat["usage"]["prompt_tokens"] == len(ids)
    assert np.allclose(chat["data"][0]["embedding"], plain["data"][0]["embedding"], atol=1e-6)
    without = httpx.post(url + "/v1/embeddings", json={"messages": messages}).json()
    assert without["usage"]["prompt_tokens"] < len(ids)  # no "[assistant]" at the end
    both = httpx.post(url + "/v1/embeddings", json={"messages": messages, "input": "x"})
    assert both.status_code == 400 and both.json()["error"]["param"] == "messages"
    # a template sent in the request would run on the server: refused, as chat refuses it
    own = httpx.post(url + "/v1/embeddings", json={"messages": messages,
                                                   "chat_template": "{{ 1 }}"})
    assert own.status_code == 400 and own.json()["error"]["param"] == "chat_template"


def test_matryoshka_dimensions_equal_sentence_transformers(matryoshka_server) -> None:
    from sentence_transformers import SentenceTransformer

    server, folder = matryoshka_server
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x")
    full = SentenceTransformer(folder, device="cpu").encode(TEXTS)
    for dims in (16, 32):
        got = np.array([d.embedding for d in client.embeddings.create(
            model="emb", input=TEXTS, dimensions=dims).data])
        ref = full[:, :dims] / np.linalg.norm(full[:, :dims], axis=-1, keepdims=True)
        assert got.shape == (3, dims)
        assert np.allclose(got, ref, atol=1e-5)
        assert np.allclose(np.linalg.norm(got, axis=-1), 1.0, atol=1e-5)
    b64 = client.embeddings.create(model="emb", input=TEXTS[0], dimensions=16,
                                   encoding_format="base64")
    assert len(base64.b64decode(b64.data[0].embedding)) == 16 * 4
    with pytest.raises(openai.BadRequestError, match="dimensions 24") as err:
        client.embeddings.create(model="emb", input="hi", dimensions=24)
    assert err.value.body["param"] == "dimensions"  # type: ignore[index]


def test_encoding_format_edge_cases(matryoshka_server) -> None:
    server, _ = matryoshka_server
    url = server.base_url + "/v1/embeddings"
    floats = httpx.post(url, json={"input": TEXTS[1], "encoding_format": "float"}).json()
    default = httpx.post(url, json={"input": TEXTS[1]}).json()
    assert floats["data"][0]["embedding"] == default["data"][0]["embedding"]
    assert isinstance(floats["data"][0]["embedding"], list)
    b64 = httpx.post(url, json={"input": [TEXTS[1], TEXTS[2]],
                                "encoding_format": "base64"}).json()
    for item, text in zip(b64["data"], TEXTS[1:]):
        vector = np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4")
        one = httpx.post(url, json={"input": text}).json()["data"][0]["embedding"]
        assert vector.shape == (64,) and np.allclose(vector, one, atol=1e-7)
    for bad in ("binary", "FLOAT", None, 1):
        answer = httpx.post(url, json={"input": "hi", "encoding_format": bad})
        assert answer.status_code == 400, (bad, answer.text)
        assert "encoding_format" in answer.text
    # vLLM's base64 options: other dtypes or byte orders are not implemented
    for field, value in (("embed_dtype", "float16"), ("endianness", "big")):
        answer = httpx.post(url, json={"input": "hi", "encoding_format": "base64",
                                       field: value})
        assert answer.status_code == 400 and answer.json()["error"]["param"] == field
    same = httpx.post(url, json={"input": "hi", "embed_dtype": "float32",
                                 "endianness": "little", "priority": 0, "cache_salt": "s"})
    assert same.status_code == 200, same.text


def test_over_long_input_is_refused_with_the_numbers(matryoshka_server,
                                                    classify_server) -> None:
    # both checkpoints' position tables hold 128 tokens
    long_text = " ".join(["fox"] * 200)
    url = matryoshka_server[0].base_url + "/v1/embeddings"
    ids = httpx.post(url, json={"input": [[7] * 129]})
    assert ids.status_code == 400, ids.text
    message = ids.json()["error"]["message"]
    assert "128" in message and "129" in message, message
    # a sentence-transformers folder cuts texts at its max_seq_length, as ST does
    cut = httpx.post(url, json={"input": long_text})
    assert cut.status_code == 200 and cut.json()["usage"]["prompt_tokens"] == 128
    kept = httpx.post(url, json={"input": [[7] * 129], "truncate_prompt_tokens": 100})
    assert kept.status_code == 200 and kept.json()["usage"]["prompt_tokens"] == 100
    # a plain checkpoint cuts nothing unless asked: 200 words and [CLS] [SEP] are 202 tokens
    url = classify_server[0].base_url + "/classify"
    text = httpx.post(url, json={"input": long_text})
    assert text.status_code == 400, text.text
    message = text.json()["error"]["message"]
    assert "128" in message and "202" in message and "truncate_prompt_tokens" in message
    cut = httpx.post(url, json={"input": long_text, "truncate_prompt_tokens": -1})
    assert cut.status_code == 200 and cut.json()["usage"]["prompt_tokens"] == 128
    # the servers are fine afterwards
    assert httpx.post(url, json={"input": "hi"}).status_code == 200


def test_unknown_fields(classify_server) -> None:
    server, _ = classify_server
    url = server.base_url
    for path, body in (("/classify", {"input": "hi"}),
                       ("/score", {"text_1": "a", "text_2": "b"}),
                       ("/rerank", {"query": "a", "documents": ["b"]})):
        refused = httpx.post(url + path, json={**body, "padding": "max_length"})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "padding"
        side = httpx.post(url + path, json={**body, "truncation_side": "right"})
        assert side.status_code == 400 and side.json()["error"]["param"] == "truncation_side"
        # fields that change nothing are ignored, as chat ignores them
        fine = httpx.post(url + path, json={**body, "priority": 0, "some_field": 1,
                                            "mm_processor_kwargs": None})
        if path == "/classify":
            assert fine.status_code == 200, fine.text
        else:  # a three-label classifier cannot score: the refusal names the model
            assert fine.status_code == 400 and fine.json()["error"]["param"] == "model"
