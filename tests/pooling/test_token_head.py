"""Qwen3-Reranker as vLLM serves it: a causal LM scored by its "yes" / "no" next-token
logits (``--hf-overrides`` with ``classifier_from_token``), checked against transformers
computing the same two logits on the same random checkpoint."""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import pytest
import torch

from server.engine.llm import LLM
from server.engine.pooling.select import build_engine
from server.models.encoders.load import checkpoint_pools
from server.models.encoders.token_head import TokenHead, TokenHeadMethod
from tests.pooling.conftest import QWEN3_RERANKER_OVERRIDES
from tests.server_process import start_server

# the prompt as Qwen3-Reranker's model card builds it: the query carries the system prompt
# and the instruction, the document the assistant turn's opening
PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the "
          "Query and the Instruct provided. Note that the answer can only be \"yes\" or "
          "\"no\".<|im_end|>\n<|im_start|>user\n")
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
QUERY = (f"{PREFIX}<Instruct>: Given a web search query, retrieve relevant passages\n"
         "<Query>: the quick fox\n")
DOCS = [f"<Document>: {d}{SUFFIX}" for d in (
    "the quick brown fox jumps over the lazy dog", "paged attention stores keys",
    "numbers 0 1 2 3 4 5 6 7 8 9 10", "café")]


def _transformers_scores(folder: str, query: str, docs: list[str]) -> list[float]:
    """P(yes) of each (query, document) prompt: the softmax of the "no" and "yes" logits of
    the last token, as Qwen3-Reranker's model card computes it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    no, yes = tok.convert_tokens_to_ids(["no", "yes"])
    scores = []
    with torch.no_grad():
        for doc in docs:
            ids = tok(query + doc, return_tensors="pt").input_ids
            logits = model(ids).logits[0, -1]
            scores.append(torch.softmax(logits[[no, yes]], dim=-1)[1].item())
    return scores


@pytest.mark.slow
@pytest.mark.parametrize("tie", [True, False])
def test_offline_scores_equal_transformers(qwen3_lm, tie: bool) -> None:
    folder = qwen3_lm(tie)
    ref = _transformers_scores(folder, QUERY, DOCS)
    llm = LLM(folder, hf_overrides=QWEN3_RERANKER_OVERRIDES, dtype="float32")
    assert llm.engine.info.cross_encoder and llm.engine.info.num_labels == 1
    got = [o.outputs.score for o in llm.score(QUERY, DOCS)]
    assert got == pytest.approx(ref, abs=1e-4)
    # the scores are not all alike (a broken head would still be a probability)
    assert max(ref) - min(ref) > 1e-3


@pytest.mark.slow
def test_rerank_and_score_through_server(qwen3_lm) -> None:
    folder = qwen3_lm(True)
    ref = _transformers_scores(folder, QUERY, DOCS)
    order = sorted(range(len(DOCS)), key=lambda i: -ref[i])
    # no --runner: the overridden architecture (*ForSequenceClassification) picks pooling
    server = start_server(folder, "--hf-overrides", json.dumps(QWEN3_RERANKER_OVERRIDES),
                          "--dtype", "float32", "--served-model-name", "qr",
                          "--max-model-len", "512")
    try:
        url = server.base_url
        answer = httpx.post(url + "/rerank", json={"model": "qr", "query": QUERY,
                                                   "documents": DOCS, "top_n": 3}).json()
        assert [r["index"] for r in answer["results"]] == order[:3]
        assert [r["relevance_score"] for r in answer["results"]] == pytest.approx(
            [ref[i] for i in order[:3]], abs=1e-4)
        v1 = httpx.post(url + "/v1/rerank", json={"query": QUERY, "documents": DOCS}).json()
        assert [r["index"] for r in v1["results"]] == order
        score = httpx.post(url + "/score", json={"model": "qr", "text_1": QUERY,
                                                 "text_2": DOCS}).json()
        assert [d["score"] for d in score["data"]] == pytest.approx(ref, abs=1e-4)
        # a reranker embeds nothing: said, not answered with a made-up vector
        embed = httpx.post(url + "/v1/embeddings", json={"input": "hi"})
        assert embed.status_code == 400
        # a prompt past the context is refused, not cut at its end (which would drop the
        # question it asks); truncate_prompt_tokens keeps its last tokens when asked
        long_doc = "<Document>: " + "the lazy dog " * 200 + SUFFIX
        too_long = httpx.post(url + "/rerank", json={"query": QUERY, "documents": [long_doc]})
        assert too_long.status_code == 400 and "context length" in too_long.text
        cut = httpx.post(url + "/rerank", json={"query": QUERY, "documents": [long_doc],
                                                "truncate_prompt_tokens": 300})
        assert cut.status_code == 200 and cut.json()["usage"]["total_tokens"] == 300
    finally:
        server.stop()


def test_token_head_settings() -> None:
    head = TokenHead.from_hf(SimpleNamespace(**QWEN3_RERANKER_OVERRIDES))
    assert head == TokenHead(("no", "yes"), TokenHeadMethod.TWO_WAY_SOFTMAX)
    assert head.num_labels == 1
    # the score head's row: yes - no, from the LM head's rows
    lm_head = torch.arange(12.0).view(4, 3)
    ids = {"no": 1, "yes": 3}
    assert head.score_weight(lm_head, ids.get).tolist() == [[6.0, 6.0, 6.0]]
    gemma = TokenHead.from_hf(SimpleNamespace(classifier_from_token=["Yes"],
                                              method="no_post_processing"))
    assert gemma is not None and gemma.num_labels == 1
    assert TokenHead.from_hf(SimpleNamespace()) is None
    with pytest.raises(ValueError, match="method"):
        TokenHead.from_hf(SimpleNamespace(classifier_from_token=["no", "yes"]))
    with pytest.raises(ValueError, match="two"):
        TokenHead.from_hf(SimpleNamespace(classifier_from_token=["yes"],
                                          is_original_qwen3_reranker=True))
    with pytest.raises(ValueError, match="not supported"):
        TokenHead.from_hf(SimpleNamespace(classifier_from_token=["a"], method="softmax"))
    with pytest.raises(ValueError, match="'yes' is not a token"):
        head.score_weight(lm_head, {"no": 1}.get)


def test_overrides_pick_the_runner_and_are_refused_when_generating(tiny_model) -> None:
    folder = tiny_model[0]
    assert not checkpoint_pools(folder)
    assert checkpoint_pools(folder, QWEN3_RERANKER_OVERRIDES)
    from server.config import make_engine_config

    config = make_engine_config(model=folder, runner="generate",
                                hf_overrides={"is_matryoshka": True})
    with pytest.raises(ValueError, match="--hf-overrides .*--runner pooling"):
        build_engine(config)
