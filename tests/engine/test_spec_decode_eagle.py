"""Speculative decoding with EAGLE heads (vLLM's ``method: eagle`` / ``eagle3``): tiny random
heads the tests build for a tiny random Llama target, saved in vLLM's checkpoint layout
(tests/spec_eagle.py). Random heads accept little, so greedy identity is checked beside a
head that copies the target's argmax under a target whose layers add almost nothing (its
drafts are accepted). Greedy output equals the target's token for token (prompts of many
lengths, n > 1, stop strings, stop tokens, max_tokens, preemption under a small cache,
prefix caching and chunked prefill beside it), sampling keeps the target's distribution
(chi-square), and compile mode warms the head's buckets before serving (0 serving
compilations)."""

from __future__ import annotations

import collections
import copy

import pytest
import torch
from spec_checks import (
    all_free,
    draft_warmed_every_bucket,
    outputs,
    serves_without_compiling,
    spec_llm,
)
from spec_draft import draft_pair, save
from spec_eagle import save_head

from server import LLM, SamplingParams
from server.config import make_engine_config


@pytest.fixture(scope="module")
def target(tiny_model, tmp_path_factory) -> str:
    """A three-layer tiny Llama (EAGLE-3's default layers (2, 1, 0) fit it)."""
    _, model, tokenizer = tiny_model
    return draft_pair(model, tokenizer, tmp_path_factory.mktemp("eagle-target"))[0]


@pytest.fixture(scope="module")
def heads(target, tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("eagle-heads")
    return {m: save_head(target, folder / m, m) for m in ("eagle", "eagle3")}


def spec(method: str, head: str, k: int = 3, **extra) -> dict:
    return {"method": method, "model": head, "num_speculative_tokens": k, **extra}


def prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist()
            for n in (1, 2, 5, 16, 17, 31, 47, 64, 130)]


def llm(folder: str, config: dict | None, **extra) -> LLM:
    return spec_llm(folder, config, **extra)


@pytest.mark.parametrize("bad, words", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "needs \"model\""),
    ({"method": "eagle3", "num_speculative_tokens": 2}, "needs \"model\""),
    ({"method": "qwen3_next_mtp", "num_speculative_tokens": 1},
     "'qwen3_next_mtp' is not supported by this"),
    ({"method": "medusa", "num_speculative_tokens": 1, "model": "x"}, "not supported"),
])
def test_config_refusals(bad: dict, words: str) -> None:
    with pytest.raises(ValueError, match="speculative-config") as info:
        make_engine_config(speculative_config=bad)
    assert words in str(info.value)


def test_vllm_spellings() -> None:
    by_name = make_engine_config(speculative_config={
        "model": "/heads/EAGLE-LLaMA3-8B", "num_speculative_tokens": 2}).speculative.settings
    assert by_name is not None and by_name.method.value == "eagle"


def test_a_head_that_does_not_fit_is_a_startup_error(target, heads, tmp_path) -> None:
    with pytest.raises(ValueError, match="EAGLE-3 architecture"):
        llm(target, spec("eagle", heads["eagle3"]))
    other = save_head(target, tmp_path / "wide", "eagle")
    text = (tmp_path / "wide" / "config.json").read_text()
    (tmp_path / "wide" / "config.json").write_text(text.replace('"vocab_size": ',
                                                                '"vocab_size": 1'))
    with pytest.raises(ValueError, match="vocabulary"):
        llm(target, spec("eagle", other))


@pytest.mark.slow
@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_greedy_identical_with_a_head(tiny_model, target, heads, method: str) -> None:
    plain = llm(target, None)
    drafted = llm(target, spec(method, heads[method]))
    batch = prompts(300)
    want = outputs(plain, batch)
    assert outputs(drafted, batch) == want
    stats = drafted.engine.stats()
    assert stats.spec_num_drafts > 0 and stats.spec_num_draft_tokens > stats.spec_num_drafts
    for fields in ({"max_tokens": 7}, {"stop_token_ids": [want[0][0][5]]},
                   {"n": 2, "max_tokens": 12}):
        assert outputs(drafted, batch, **fields) == outputs(plain, batch, **fields)
    # a stop string inside the output: both cut at the same token
    tokenizer = tiny_model[2]  # the target's (draft_pair saves it beside the weights)
    text = tokenizer.decode(want[2][0][:20])
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop
    assert outputs(drafted, batch[:4], stop=[stop]) == outputs(plain, batch[:4], stop=[stop])
    seeded = {"n": 3, "temperature": 1.0, "seed": 7}
    assert outputs(drafted, batch, **seeded) == outputs(drafted, batch, **seeded)
    assert all_free(drafted)


@pytest.mark.slow
def test_preemption_prefix_caching_and_chunked_prefill_beside_it(target, heads) -> None:
    """The head's cache and the feature rows follow the target's blocks: preempted and
    recomputed, served from the prefix cache, chunked."""
    batch = prompts(300)
    want = outputs(llm(target, None), batch)
    for method in ("eagle", "eagle3"):
        config = spec(method, heads[method])
        tight = llm(target, config, num_gpu_blocks_override=24, enable_prefix_caching=True)
        assert outputs(tight, batch) == want
        assert tight.engine.scheduler.num_preemptions > 0
        assert all_free(tight)
        chunked = llm(target, config, enable_chunked_prefill=True,
                      max_num_batched_tokens=48, enable_prefix_caching=True)
        assert outputs(chunked, batch) == want
        assert outputs(chunked, batch) == want  # again, the prompts from the prefix cache
        assert chunked.engine.stats().prefix_cache_hits >= 128
        assert all_free(chunked)


@pytest.fixture(scope="module")
def damped(tiny_model, tmp_path_factory) -> tuple[str, str]:
    """(target, head): a target whose layers add almost nothing to the stream (its argmax is
    its LM head over the current token's embedding) and an EAGLE-1 head proposing exactly
    that (fc passes the embedding through, its layer adds nothing): drafts are accepted."""
    _, model, tokenizer = tiny_model
    quiet = copy.deepcopy(model)
    with torch.no_grad():
        for layer in quiet.model.layers:
            layer.self_attn.o_proj.weight.mul_(1e-3)
            layer.mlp.down_proj.weight.mul_(1e-3)
    folder = tmp_path_factory.mktemp("damped")
    path = save(quiet, tokenizer, folder / "target")
    return path, save_head(path, folder / "head", "eagle", copies_embedding=True)


@pytest.mark.slow
def test_a_head_that_agrees_is_accepted(damped) -> None:
    target, head = damped
    batch = prompts(300)
    want = outputs(llm(target, None), batch)
    drafted = llm(target, spec("eagle", head))
    assert outputs(drafted, batch) == want
    stats = drafted.engine.stats()
    assert stats.spec_num_accepted_tokens > 0.9 * stats.spec_num_draft_tokens > 0


@pytest.mark.slow
def test_sampled_distribution_is_the_targets(damped) -> None:
    """Chi-square (two samples, 1% significance) on the first three tokens' joint outcome,
    head on vs off, with top-k and a presence penalty; both branches of the rule run."""
    from scipy.stats import chi2_contingency

    target, head = damped
    prompt = [11, 12, 13, 14] * 6
    params = SamplingParams(temperature=1.0, top_k=4, max_tokens=3, ignore_eos=True,
                            presence_penalty=0.5)
    counts = []
    accepted = rejected = 0
    for config in (None, spec("eagle", head, k=2)):
        engine = llm(target, config, max_num_seqs=64)
        outs = engine.generate([prompt] * 1500, params)
        counts.append(collections.Counter(tuple(o.outputs[0].token_ids) for o in outs))
        stats = engine.engine.stats()
        accepted = stats.spec_num_accepted_tokens
        rejected = stats.spec_num_draft_tokens - accepted
    assert accepted > 50 and rejected > 50
    keys = sorted(set(counts[0]) | set(counts[1]))
    table = [[c.get(k, 0) + 0.5 for k in keys] for c in counts]
    assert chi2_contingency(table)[1] > 0.01


@pytest.mark.slow
def test_compile_mode_warms_the_head_and_serves_without_compiling(target, heads,
                                                                 tmp_path) -> None:
    # a small plan (2 sequences, 64 positions, 10 buckets: the default one has 30, ~3 s of
    # C++ each on a cold compile cache), which warmup compiles twice: target and head
    buckets = tmp_path / "b.txt"
    buckets.write_text("(1, [16, 32], [0, 2, 4])\n([2], 1, [4, 8])\n")
    engine = LLM(target, dtype="float32", block_size=16, max_num_seqs=2,
                 max_model_len=64, execution_mode="compile",
                 speculative_config=spec("eagle3", heads["eagle3"]),
                 environ={"VLLM_BUCKETING_FROM_FILE": str(buckets)})
    draft_warmed_every_bucket(engine)
    serves_without_compiling(engine, [p[:30] for p in prompts(300)], 30, 15)
