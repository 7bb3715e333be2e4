"""Compile mode: a randomized workload over 6 adapters with 4 slots, adapters dropped and
loaded again during it, runs on the warmed buckets only (0 serving compilations, 0 bucket
misses), and every answer equals transformers with that adapter merged."""

from __future__ import annotations

import random

import pytest

from server import LLM, LoRARequest, SamplingParams
from tests.lora.conftest import hf_greedy, merged

NEW_TOKENS = 6


@pytest.mark.slow
def test_six_adapters_four_slots_never_compile_while_serving(tiny_model, adapter_factory,
                                                             tmp_path) -> None:
    folder, hf_model, _ = tiny_model
    paths = [adapter_factory(hf_model, 8 if i % 2 else 16, seed=100 + i) for i in range(6)]
    refs = [merged(hf_model, p) for p in paths]
    buckets = tmp_path / "b.txt"
    buckets.write_text("([1, 2, 4, 8], 32, [0])\n([4, 8], 1, [8, 16])\n")
    llm = LLM(folder, dtype="float32", block_size=16, max_num_seqs=8, max_model_len=64,
              execution_mode="compile", enable_lora=True, max_loras=4, max_lora_rank=16,
              max_cpu_loras=4, enable_prefix_caching=False,
              environ={"VLLM_BUCKETING_FROM_FILE": str(buckets)})
    counters = llm.engine.counters
    assert counters.compilations(stage="serving") == 0
    rng = random.Random(0)
    vocab = hf_model.config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for round_ in range(4):
        prompts = [[rng.randrange(3, vocab) for _ in range(rng.randrange(3, 20))]
                   for _ in range(8)]
        chosen = [rng.choice([None, *range(6)]) for _ in prompts]
        loras = [None if i is None else LoRARequest(f"l{i}", i + 1, paths[i]) for i in chosen]
        outputs = llm.generate(prompts, params, lora_request=loras)
        for prompt, i, out in zip(prompts, chosen, outputs):
            ref = hf_model if i is None else refs[i]
            assert out.outputs[0].token_ids == hf_greedy(ref, prompt, NEW_TOKENS), (round_, i)
        # unload two adapters (slot and host copy freed); the next round loads them again
        for i in rng.sample(range(6), 2):
            llm.engine.remove_lora(i + 1)
    assert llm.engine.runner.lora.num_slot_loads > 6  # slots were reused, not only filled
    assert counters.compilations(stage="serving") == 0
    assert sum(counters._misses.labels(counters.model_name, p)._value.get()
               for p in ("prefill", "decode")) == 0
