"""ModernBERT (global and local attention layers, RoPE, GeGLU, no biases) against
sentence-transformers and transformers on tiny random checkpoints the tests build."""

from __future__ import annotations

import random

import pytest
import torch

from server.engine.llm import LLM
from server.engine.pooling.params import PoolingParams
from server.hpu.cpu.linear import PackedLinear, packing_supported
from tests.conftest import CORPUS
from tests.pooling.conftest import save_hf

pytestmark = pytest.mark.slow

# longer than a local layer's window (4 positions either side): a global layer read as a
# local one, or the reverse, changes every vector
TEXTS = ["the quick brown fox jumps over the lazy dog",
         "paged attention stores keys",
         "numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000 continuous batching lets new prompts join "
         "between steps the quick brown fox jumps over the lazy dog again and again",
         "café"]


@pytest.mark.parametrize(("pooling", "normalize"), [("cls", True), ("mean", False)])
def test_embeddings_equal_sentence_transformers(st_folder, pooling: str,
                                                normalize: bool) -> None:
    from sentence_transformers import SentenceTransformer

    folder = st_folder("modernbert", pooling, normalize, max_seq_length=24)
    ref = SentenceTransformer(folder, device="cpu").encode(TEXTS, convert_to_tensor=True)
    llm = LLM(folder, dtype="float32", max_num_seqs=4)
    outs = llm.embed(TEXTS)
    got = torch.tensor([o.outputs.embedding for o in outs])
    assert torch.cosine_similarity(got, ref.float(), dim=-1).min().item() >= 0.9999
    # elementwise too: a tiny random model's attention moves vectors little, so a local
    # layer run as a global one still passes the cosine bar (0.99999) but not this one
    assert (got - ref.float()).abs().max().item() < 1e-4
    assert torch.allclose(got.norm(dim=-1), ref.norm(dim=-1), rtol=1e-3)
    assert len(outs[2].prompt_token_ids) == 24  # cut to max_seq_length, as ST cuts it
    model = llm.engine.loaded.model
    if next(model.parameters()).device.type == "cpu" and packing_supported(torch.float32):
        assert isinstance(model.layers[1].mlp.Wi, PackedLinear)  # the packed CPU path ran


def test_scores_equal_cross_encoder(cross_encoder) -> None:
    from sentence_transformers import CrossEncoder

    folder = cross_encoder("modernbert")
    query = "quick fox"
    ref = CrossEncoder(folder, device="cpu").predict([(query, d) for d in TEXTS])
    got = [o.outputs.score for o in LLM(folder, dtype="float32").score(query, TEXTS)]
    assert got == pytest.approx(list(map(float, ref)), abs=1e-4)
    assert sorted(range(len(got)), key=lambda i: -got[i]) == sorted(
        range(len(ref)), key=lambda i: -ref[i])


def test_mean_pooled_classifier_equals_transformers(tmp_path) -> None:
    from transformers import AutoTokenizer, ModernBertForSequenceClassification

    save_hf(tmp_path, "modernbert", classify=True, num_labels=3, seed=3,
            config_kwargs={"classifier_pooling": "mean"})
    tok = AutoTokenizer.from_pretrained(tmp_path)
    model = ModernBertForSequenceClassification.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        ref = [torch.softmax(model(**tok(t, return_tensors="pt")).logits[0], -1).tolist()
               for t in TEXTS]
    got = [o.outputs.probs for o in LLM(str(tmp_path), dtype="float32").classify(TEXTS)]
    for g, r in zip(got, ref):
        assert g == pytest.approx(r, abs=1e-4)


def test_no_serving_compilations_over_random_mix(st_folder) -> None:
    llm = LLM(st_folder("modernbert", "mean", True), execution_mode="compile",
              max_model_len=32, max_num_seqs=2, dtype="float32")
    counters = llm.engine.counters
    assert counters.compilations(stage="warmup") > 0
    rng = random.Random(0)
    words = " ".join(CORPUS).split()
    cut = PoolingParams(truncate_prompt_tokens=-1)
    for _ in range(6):
        texts = [" ".join(rng.choices(words, k=rng.randint(1, 40)))
                 for _ in range(rng.randint(1, 9))]
        assert len(llm.embed(texts, cut)) == len(texts)
    assert counters.compilations(stage="serving") == 0
