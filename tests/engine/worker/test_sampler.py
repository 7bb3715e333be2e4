"""The batched sampler on hand-made logits."""

from __future__ import annotations

import math

import pytest
import torch

from server.engine.core.sequence import Sequence
from server.engine.sampling_params import SamplingParams
from server.engine.worker.sampler import (
    Sampler,
    SamplingTensors,
    apply_penalties,
    to_token_logprobs,
)

V = 8
EOS = 7
CPU = torch.device("cpu")


def seqs_for(params: list[SamplingParams], outputs: list[list[int]] | None = None) -> list[Sequence]:
    seqs = []
    for i, p in enumerate(params):
        seq = Sequence(i, f"r{i}", 0, [1, 2, 2], p, 0.0)
        seq.output_token_ids = list(outputs[i]) if outputs else []
        seqs.append(seq)
    return seqs


def sample(logits: torch.Tensor, seqs: list[Sequence]):
    return Sampler()(logits, SamplingTensors.build(seqs, V, {EOS}, CPU))


def test_greedy_is_argmax_and_fast_path_has_no_logprobs() -> None:
    logits = torch.randn(5, V)
    out = sample(logits, seqs_for([SamplingParams(temperature=0)] * 5))
    assert out.token_ids.tolist() == logits.argmax(-1).tolist()
    assert out.logprobs is None
    assert out.top_ids is None


def test_temperature_sampling_follows_softmax() -> None:
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -9, -9, -9, -9]])
    draws = 4000
    params = [SamplingParams(temperature=0.7)] * draws
    out = sample(logits.expand(draws, V), seqs_for(params))
    freq = torch.bincount(out.token_ids, minlength=V).float() / draws
    expected = torch.softmax(logits[0] / 0.7, -1)
    assert torch.allclose(freq, expected, atol=0.03)


def test_top_k_top_p_min_p_restrict_support() -> None:
    torch.manual_seed(0)
    logits = torch.tensor([[3.0, 2.5, 2.0, 1.0, 0.0, -1.0, -2.0, -3.0]])
    n = 2000

    def support(**kw) -> set[int]:
        out = sample(logits.expand(n, V), seqs_for([SamplingParams(temperature=1.0, **kw)] * n))
        return set(out.token_ids.tolist())

    assert support(top_k=1) == {0}
    assert support(top_k=3) == {0, 1, 2}
    probs = torch.softmax(logits[0], -1)
    # the nucleus: smallest prefix whose mass reaches top_p
    top_p = float(probs[:2].sum()) - 1e-3
    assert support(top_p=top_p) == {0, 1}
    min_p = float(probs[2] / probs[0]) + 1e-3  # token 2 is just below the cut
    assert support(min_p=min_p) == {0, 1}


def test_seeded_rows_are_batch_invariant() -> None:
    torch.manual_seed(0)
    target = SamplingParams(temperature=1.0, seed=42)
    steps = [torch.randn(16, V) for _ in range(5)]
    alone_seq = seqs_for([target])
    alone = [sample(s[3:4], alone_seq).token_ids.item() for s in steps]
    mates = [SamplingParams(temperature=0.5 + i / 10, top_k=i % 4 or -1) for i in range(15)]
    batch = seqs_for(mates[:3] + [target] + mates[3:])
    mixed = [sample(s, batch).token_ids[3].item() for s in steps]
    assert mixed == alone
    # n > 1: completions of one seeded request draw different streams
    a, b = seqs_for([target, target])
    b.index = 1
    draws_a = [sample(s[:1], [a]).token_ids.item() for s in steps * 4]
    draws_b = [sample(s[:1], [b]).token_ids.item() for s in steps * 4]
    assert draws_a != draws_b


def test_logit_bias_and_min_tokens() -> None:
    logits = torch.zeros(3, V)
    logits[:, EOS] = 5.0
    logits[:, 4] = 4.0
    params = [
        SamplingParams(temperature=0, logit_bias={2: 100.0}),
        SamplingParams(temperature=0, min_tokens=2),  # EOS blocked: 0 outputs so far
        SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[4]),
    ]
    out = sample(logits, seqs_for(params))
    assert out.token_ids.tolist()[0] == 2
    assert out.token_ids.tolist()[1] == 4
    assert out.token_ids.tolist()[2] not in (EOS, 4)
    # once min_tokens is reached, EOS is allowed again
    out = sample(logits, seqs_for(params, outputs=[[1], [1, 1], [1, 1]]))
    assert out.token_ids.tolist()[1:] == [EOS, EOS]


def test_penalties_follow_vllm_formulas() -> None:
    logits = torch.tensor([[1.0, -1.0, 2.0, 0.5, 0.0, 0.0, 0.0, 0.0]])
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0)
    seq = seqs_for([p], outputs=[[0, 0, 3]])  # prompt [1, 2, 2]
    t = SamplingTensors.build(seq, V, {EOS}, CPU)
    got = apply_penalties(logits.clone(), t)[0]
    expected = logits[0].clone()
    expected[0] = 1.0 / 2.0 - 0.25 * 2 - 0.5  # output twice: repetition, frequency, presence
    expected[1] = -1.0 * 2.0  # prompt only: repetition (negative -> multiplied)
    expected[2] = 2.0 / 2.0
    expected[3] = 0.5 / 2.0 - 0.25 - 0.5
    torch.testing.assert_close(got, expected)


def test_logprobs_of_processed_logits_sorted_top_k() -> None:
    logits = torch.randn(3, V)
    params = [SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=0),
              SamplingParams(temperature=0, logprobs=0, logit_bias={5: 1.5})]
    seqs = seqs_for(params)
    out = sample(logits, seqs)
    biased = logits.clone()
    biased[2, 5] += 1.5
    ref = torch.log_softmax(biased, -1)
    lps = to_token_logprobs(out, seqs)
    assert lps[1] is None
    first = lps[0]
    assert first is not None
    assert first.token_id == out.token_ids[0].item()
    assert math.isclose(first.logprob, ref[0].max().item(), rel_tol=1e-5)
    assert [t for t, _ in first.top] == ref[0].topk(3).indices.tolist()
    assert all(a[1] >= b[1] for a, b in zip(first.top, first.top[1:]))
    assert lps[2] is not None
    assert lps[2].top == []
    assert math.isclose(lps[2].logprob, ref[2, out.token_ids[2]].item(), rel_tol=1e-5)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_all_tokens_valid(temperature: float) -> None:
    out = sample(torch.randn(64, V), seqs_for([SamplingParams(temperature=temperature)] * 64))
    assert bool(((out.token_ids >= 0) & (out.token_ids < V)).all())


def test_top_k_beyond_the_vocabulary_keeps_every_token_in_a_mixed_batch() -> None:
    # One row asks for more tokens than the vocabulary has, its neighbour for two: the first
    # must behave as top-k disabled, and the batch must not fail.
    logits = torch.randn(2, V)
    params = [SamplingParams(temperature=1.0, top_k=10**6),
              SamplingParams(temperature=1.0, top_k=2)]
    seen: set[int] = set()
    for _ in range(200):
        out = sample(logits, seqs_for(params))
        seen.add(out.token_ids[0].item())
        assert out.token_ids[1].item() in logits[1].topk(2).indices.tolist()
    assert len(seen) > 2


def _sorted_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    kth = logits.sort(dim=-1, descending=True).values.gather(1, (top_k - 1).unsqueeze(1))
    return logits < kth


def _sorted_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    ordered, order = logits.sort(dim=-1, descending=True)
    probs = ordered.softmax(dim=-1)
    drop = (probs.cumsum(dim=-1) - probs) >= top_p.unsqueeze(1)
    return torch.zeros_like(drop).scatter(1, order, drop)


@pytest.mark.parametrize("peaked", [True, False])
def test_large_vocabulary_top_k_top_p_cut_where_a_full_sort_does(peaked: bool) -> None:
    """At a real vocabulary size top-k / top-p read the head of each row (topk) instead of
    sorting it: the tokens they drop are the full sort's, whether the cut lies inside the
    head (peaked rows, a model's usual case) or beyond it (flat rows: the full sort)."""
    from server.engine.worker.sampler import MIN_PARTIAL_VOCAB, _apply_top_k, _apply_top_p

    torch.manual_seed(0)
    vocab = 4 * MIN_PARTIAL_VOCAB
    logits = torch.randn(6, vocab) * 2
    if peaked:
        logits[:, :40] += torch.randn(6, 40) * 4 + 8
    top_k = torch.tensor([1, 5, 50, 300, vocab, 2000])
    top_p = torch.tensor([0.9, 0.5, 0.99, 0.1, 0.7, 0.95])
    assert torch.equal(torch.isneginf(_apply_top_k(logits, top_k)),
                       _sorted_top_k(logits, top_k))
    assert torch.equal(torch.isneginf(_apply_top_p(logits, top_p)),
                       _sorted_top_p(logits, top_p))
    # a row at top_p 1.0 beside cut rows keeps every token
    mixed = torch.tensor([0.9, 1.0, 0.9, 1.0, 0.5, 0.9])
    kept = ~torch.isneginf(_apply_top_p(logits, mixed))
    assert kept[1].all() and kept[3].all()
    assert torch.equal(kept[0], ~_sorted_top_p(logits, mixed)[0])
