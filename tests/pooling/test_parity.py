"""Embeddings and scores equal sentence-transformers' on the same folders (offline API)."""

from __future__ import annotations

import pytest
import torch

from server.engine.llm import LLM
from server.hpu.cpu.linear import PackedLinear, packing_supported

TEXTS = ["the quick brown fox jumps over the lazy dog",
         "paged attention stores keys",
         "numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000 continuous batching lets new prompts join "
         "between steps the quick brown fox jumps over the lazy dog again and again",
         "café"]


def _cosines(got: list[list[float]], ref: torch.Tensor) -> list[float]:
    return [torch.cosine_similarity(torch.tensor(g), r.float(), dim=0).item()
            for g, r in zip(got, ref)]


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "pooling", "normalize"), [
    ("bert", "mean", True), ("bert", "cls", False), ("xlm-roberta", "cls", True),
    ("xlm-roberta", "mean", False), ("qwen3", "lasttoken", True), ("qwen3", "mean", False),
])
def test_embeddings_equal_sentence_transformers(st_folder, kind: str, pooling: str,
                                                normalize: bool) -> None:
    from sentence_transformers import SentenceTransformer

    folder = st_folder(kind, pooling, normalize, max_seq_length=24)
    ref = SentenceTransformer(folder, device="cpu").encode(TEXTS, convert_to_tensor=True)
    llm = LLM(folder, dtype="float32", max_num_seqs=4)
    outs = llm.embed(TEXTS)
    got = [o.outputs.embedding for o in outs]
    assert min(_cosines(got, ref)) >= 0.9999
    # the norm too: normalized exactly when the folder lists a Normalize module
    norms = [float(torch.tensor(g).norm()) for g in got]
    assert all(abs(n - r) < 1e-3 * r for n, r in zip(norms, ref.norm(dim=-1).tolist()))
    # the long text was cut to max_seq_length, as sentence-transformers cuts it
    assert len(outs[2].prompt_token_ids) == 24
    on_cpu = next(llm.engine.loaded.model.parameters()).device.type == "cpu"
    if kind != "qwen3" and on_cpu and packing_supported(torch.float32):
        # what ran was the packed path (oneDNN GEMMs, GELU fused), not plain PyTorch
        # (a CPU path: on a GPU machine the encoder runs on CUDA, checked equal above)
        inter = llm.engine.loaded.model.encoder.layer[0].intermediate
        assert isinstance(inter.dense, PackedLinear) and inter.act_fused


@pytest.mark.slow
def test_bf16_embeddings_close(st_folder) -> None:
    from sentence_transformers import SentenceTransformer

    folder = st_folder("bert", "mean", True)
    ref = SentenceTransformer(folder, device="cpu").encode(TEXTS, convert_to_tensor=True)
    got = [o.outputs.embedding for o in LLM(folder, dtype="bfloat16").embed(TEXTS)]
    assert min(_cosines(got, ref)) >= 0.999


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["bert", "xlm-roberta"])
def test_scores_equal_cross_encoder(cross_encoder, kind: str) -> None:
    from sentence_transformers import CrossEncoder

    folder = cross_encoder(kind)
    query, docs = "quick fox", TEXTS
    ref = CrossEncoder(folder, device="cpu").predict([(query, d) for d in docs])
    llm = LLM(folder, dtype="float32")
    got = [o.outputs.score for o in llm.score(query, docs)]
    assert got == pytest.approx(list(map(float, ref)), abs=1e-4)
    assert sorted(range(len(got)), key=lambda i: -got[i]) == sorted(
        range(len(ref)), key=lambda i: -ref[i])
