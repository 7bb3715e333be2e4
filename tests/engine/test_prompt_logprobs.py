"""prompt_logprobs against transformers' log_softmax of the same prompt (fp32, tiny Llama):
cold, after an identical earlier prompt (which a prompt_logprobs request must not read from
the prefix cache), with chunked prefill splitting the prompt, with n > 1 and preemption; and
in compile mode without a compilation while serving."""

from __future__ import annotations

import pytest
import torch

from server import LLM, SamplingParams
from server.engine.outputs import TokenLogprob

K = 3


def reference(hf_model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def check(scored: list[TokenLogprob | None] | None, want: torch.Tensor, prompt: list[int],
          k: int = K) -> None:
    assert scored is not None and len(scored) == len(prompt)
    assert scored[0] is None
    for pos, entry in enumerate(scored[1:], start=1):
        row = want[pos - 1]
        assert entry is not None and entry.token_id == prompt[pos]
        assert entry.logprob == pytest.approx(row[prompt[pos]].item(), abs=1e-4)
        assert entry.rank == int((row > row[prompt[pos]]).sum()) + 1
        top = row.topk(k)
        assert [t for t, _ in entry.top] == top.indices.tolist()
        assert [lp for _, lp in entry.top] == pytest.approx(top.values.tolist(), abs=1e-4)


def prompt_of(n: int, seed: int = 3) -> list[int]:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.slow  # the fused kernel's first build, two engines
@pytest.mark.parametrize("kernels", ["1", "0"], ids=["fused-kernel", "pytorch"])
def test_cold_cached_and_chunked_equal_transformers(tiny_model, kernels: str) -> None:
    folder, hf_model, _ = tiny_model
    prompt = prompt_of(53)  # 3 full blocks of 16 and 5
    want = reference(hf_model, prompt)
    params = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=K)
    llm = LLM(folder, dtype="float32", block_size=16, enable_prefix_caching=True,
              environ={"HPU_SERVE_CPU_KERNELS": kernels})
    out = llm.generate([prompt], params)[0]
    check(out.prompt_logprobs, want, prompt)
    # an identical prompt without prompt_logprobs fills the cache (and hits it)...
    plain = SamplingParams(temperature=0.0, max_tokens=3)
    llm.generate([prompt], plain)
    hits = llm.engine.stats().prefix_cache_hits
    assert hits == 48
    # ...which the prompt_logprobs request must not read: the same answer as cold
    again = llm.generate([prompt], params)[0]
    check(again.prompt_logprobs, want, prompt)
    assert llm.engine.stats().prefix_cache_hits == hits
    assert again.outputs[0].token_ids == out.outputs[0].token_ids
    # a request without it carries none
    assert llm.generate([prompt], plain)[0].prompt_logprobs is None
    # chunked prefill: the prompt split over steps of 16 tokens, batched with another
    chunked = LLM(folder, dtype="float32", block_size=16, enable_chunked_prefill=True,
                  max_num_batched_tokens=16, max_num_seqs=4,
                  environ={"HPU_SERVE_CPU_KERNELS": kernels})
    other = prompt_of(20, seed=4)
    outs = chunked.generate([prompt, other], [params, SamplingParams(
        temperature=0.0, max_tokens=3, prompt_logprobs=0)])
    check(outs[0].prompt_logprobs, want, prompt)
    check(outs[1].prompt_logprobs, reference(hf_model, other), other, k=0)
    assert outs[0].outputs[0].token_ids == out.outputs[0].token_ids


@pytest.mark.slow  # 11 s
def test_n_and_preemption_score_the_prompt_once(tiny_model) -> None:
    folder, hf_model, _ = tiny_model
    prompts = [prompt_of(40, seed=s) for s in range(4)]
    llm = LLM(folder, dtype="float32", block_size=16, num_gpu_blocks_override=12,
              max_num_seqs=4)
    params = SamplingParams(temperature=1.0, seed=1, n=2, max_tokens=40, ignore_eos=True,
                            prompt_logprobs=1)
    outs = llm.generate(prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        check(out.prompt_logprobs, reference(hf_model, prompt), prompt, k=1)
    stats = llm.engine.stats()
    assert stats.num_free_blocks == stats.num_blocks


@pytest.mark.slow  # compile mode
def test_compile_mode_scores_without_compiling(tiny_model, tmp_path) -> None:
    folder, hf_model, _ = tiny_model
    buckets = tmp_path / "b.txt"
    buckets.write_text("(1, [16, 64], [0, 2, 4])\n(1, 1, [4, 8])\n")
    llm = LLM(folder, dtype="float32", block_size=16, max_num_seqs=1, max_model_len=128,
              execution_mode="compile", environ={"VLLM_BUCKETING_FROM_FILE": str(buckets)})
    prompt = prompt_of(51)
    params = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=K)
    plain = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4))[0]
    out = llm.generate([prompt], params)[0]
    check(out.prompt_logprobs, reference(hf_model, prompt), prompt)
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    counters = llm.engine.counters
    assert counters.compilations(stage="serving") == 0
    assert sum(counters._misses.labels(counters.model_name, p)._value.get()
               for p in ("prefill", "decode")) == 0
