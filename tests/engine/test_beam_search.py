"""Beam search (vLLM's ``LLM.beam_search``; server/engine/beam_search.py): token for token
transformers' ``generate(num_beams=k)`` on the tiny random Llama, every returned beam in
its order; and the search's own rules on hand-made candidates (EOS endings, the length
penalty, early stopping, the context bound)."""

from __future__ import annotations

import pytest
import torch

from server.engine.beam_search import BeamSearch, BeamSearchParams
from server.engine.outputs import TokenLogprob

EOS = 2


def hf_beams(model, prompt: list[int], width: int, new_tokens: int) -> list[list[int]]:
    """transformers' beams (EOS kept from ending them: min_new_tokens, as ignore_eos)."""
    out = model.generate(torch.tensor([prompt]), num_beams=width,
                         num_return_sequences=width, do_sample=False,
                         max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         early_stopping=False, length_penalty=1.0)
    return [seq[len(prompt):].tolist() for seq in out]


@pytest.fixture(scope="module")
def llm(tiny_model):
    from server import LLM

    return LLM(tiny_model[0], dtype="float32", block_size=16, max_num_seqs=16)


def random_prompts(vocab: int, lengths: tuple[int, ...]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.parametrize("width, new_tokens", [(2, 6), (3, 8), (4, 5)])
def test_beams_equal_transformers(llm, tiny_model, width: int, new_tokens: int) -> None:
    from server import BeamSearchParams

    model = tiny_model[1]
    prompts = random_prompts(model.config.vocab_size, (5, 19, 33))
    params = BeamSearchParams(beam_width=width, max_tokens=new_tokens, ignore_eos=True)
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, out in zip(prompts, outputs):
        mine = [c.token_ids for c in out.outputs]
        assert len(set(map(tuple, mine))) == width  # distinct beams
        assert mine == hf_beams(model, prompt, width, new_tokens)
        assert [c.index for c in out.outputs] == list(range(width))
        assert all(c.finish_reason == "length" for c in out.outputs)


def test_text_prompts_and_beams_share_prefix_blocks(llm) -> None:
    from server import BeamSearchParams

    before = llm.engine.stats().prefix_cache_hits
    out = llm.beam_search("the quick brown fox jumps over the lazy dog again and again",
                          BeamSearchParams(beam_width=3, max_tokens=4, ignore_eos=True))[0]
    assert len(out.outputs) == 3 and all(c.text for c in out.outputs)
    # each step's beams re-read their prompt's full blocks from the prefix cache
    assert llm.engine.stats().prefix_cache_hits > before


def expansion(*pairs: tuple[int, float]) -> TokenLogprob:
    return TokenLogprob(pairs[0][0], pairs[0][1], list(pairs))


def test_an_eos_candidate_is_a_finished_hypothesis_scored_without_it() -> None:
    search = BeamSearch([7, 8], BeamSearchParams(beam_width=2, max_tokens=3), EOS)
    search.advance([expansion((EOS, -0.1), (5, -0.5), (6, -0.7), (9, -3.0))])
    assert [b.tokens for b in search.beams] == [[5], [6]]  # EOS left the live beams
    assert [b.tokens for b in search.finished] == [[EOS]]
    search.advance([expansion((10, -2.0), (11, -2.1), (EOS, -5.0), (12, -6.0)),
                    expansion((10, -2.0), (11, -2.2), (EOS, -5.0), (12, -6.0))])
    search.advance([expansion((13, -1.0), (14, -1.1), (EOS, -9.0), (15, -9.0)),
                    expansion((13, -1.0), (14, -1.1), (EOS, -9.0), (15, -9.0))])
    assert search.done
    out = search.output("r", lambda ids: " ".join(map(str, ids)))
    # [EOS] after the prompt: -0.1 / 2 tokens (EOS not counted), the best of all
    first = out.outputs[0]
    assert first.token_ids == [] and first.text == "" and first.finish_reason == "stop"
    assert first.stop_reason == EOS
    assert out.outputs[1].token_ids == [5, 10, 13] and out.outputs[1].finish_reason == "length"


def test_length_penalty_decides_between_short_and_long() -> None:
    def run(penalty: float) -> list[int]:
        search = BeamSearch([1], BeamSearchParams(beam_width=1, max_tokens=2,
                                                  length_penalty=penalty), EOS)
        search.advance([expansion((EOS, -1.0), (5, -1.2))])  # [EOS]: len 1; [5] goes on
        search.advance([expansion((6, -1.0), (7, -4.0))])  # [5, 6]: -2.2 over len 3
        return search.output("r", str).outputs[0].token_ids

    assert run(1.0) == [5, 6]  # per token: -2.2 / 3 = -0.73 beats [EOS]'s -1.0 / 1
    assert run(0.0) == []  # raw sums: -1.0 beats -2.2


def test_early_stopping_and_the_context_bound() -> None:
    params = BeamSearchParams(beam_width=1, max_tokens=10, early_stopping=True)
    search = BeamSearch([1], params, EOS)
    search.advance([expansion((EOS, -0.5), (4, -0.6))])
    assert search.done and search.steps == 1
    bounded = BeamSearch([1, 2, 3], BeamSearchParams(beam_width=1, max_tokens=10), EOS,
                         max_model_len=5)
    bounded.advance([expansion((4, -0.1), (5, -0.2))])
    bounded.advance([expansion((4, -0.1), (5, -0.2))])
    assert bounded.done and bounded.steps == 2


def test_include_stop_str_in_output_keeps_the_eos_token() -> None:
    params = BeamSearchParams(beam_width=1, max_tokens=2, include_stop_str_in_output=True)
    search = BeamSearch([1], params, EOS)
    search.advance([expansion((4, -0.1), (5, -0.2))])
    search.advance([expansion((EOS, -0.1), (5, -3.0))])
    first = search.output("r", lambda ids: ",".join(map(str, ids))).outputs[0]
    assert first.token_ids == [4, EOS] and first.text == "4"
