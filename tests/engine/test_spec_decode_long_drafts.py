"""Speculative decoding with k up to 8 drafts (a verify step of up to 9 tokens per
sequence) on every linear path: fp32 packed and plain PyTorch linears, and a GGUF's own
4-bit weights, which serve one sequence's whole verify step (as they serve its plain
decode step: the same numerics, so greedy output is identical)."""

from __future__ import annotations

import pytest
import torch

from server import LLM, SamplingParams
from server.hpu.cpu.linear import INT4_MAX_ROWS, SmallBatchInt4Linear, int4_max_rows

K = 8
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}


class _Codes:
    def __init__(self, n: int, k: int, group: int) -> None:
        gen = torch.Generator().manual_seed(0)
        self.codes = torch.randint(0, 16, (n, k), generator=gen)
        self.scale = torch.rand(n, k // group, generator=gen) * 0.01
        self.zero = torch.rand(n, k // group, generator=gen) * 0.01


class _NoDense(torch.nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise AssertionError("the dense weights ran")


@pytest.mark.skipif(not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"),
                    reason="no CPU int4 kernel in this torch build")
def test_a_verify_step_runs_the_int4_codes_with_one_rows_numerics() -> None:
    assert int4_max_rows(1) == INT4_MAX_ROWS and int4_max_rows(K + 1) == K + 1
    dense = _NoDense(128, 64, bias=False)
    layer = SmallBatchInt4Linear(dense, _Codes(64, 128, 32), 32, int4_max_rows(K + 1),
                                 torch.bfloat16)
    x = torch.randn(1, K + 1, 128, dtype=torch.bfloat16)
    rows = layer(x)  # [1, k + 1, out]: never the dense weights
    one_by_one = torch.cat([layer(x[:, j:j + 1]) for j in range(K + 1)], dim=1)
    assert torch.equal(rows, one_by_one)
    with pytest.raises(AssertionError, match="dense"):  # past one sequence: dense
        layer(torch.randn(K + 2, 128, dtype=torch.bfloat16))


def grounded(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [list(range(5, 25)) * 4, [7, 8, 9] * 10,
            torch.randint(3, vocab, (40,), generator=gen).tolist() * 2]


@pytest.mark.slow
@pytest.mark.parametrize("kernels", [True, False], ids=["packed-fused", "pytorch"])
def test_k8_greedy_identical_fp32(tiny_model, kernels: bool) -> None:
    env = {"HPU_SERVE_CPU_KERNELS": "1" if kernels else "0"}
    common = {"dtype": "float32", "block_size": 16, "max_num_seqs": 4, "environ": env}
    plain = LLM(tiny_model[0], **common)
    spec = LLM(tiny_model[0], speculative_config=NGRAM, **common)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    batch = grounded(300)
    want = [o.outputs[0].token_ids for o in plain.generate(batch, params)]
    assert [o.outputs[0].token_ids for o in spec.generate(batch, params)] == want
    assert [spec.generate([p], params)[0].outputs[0].token_ids for p in batch] == want
    stats = spec.engine.stats()
    assert len(stats.spec_accepted_per_pos) == K
    assert stats.spec_accepted_per_pos[K - 1] > 0  # whole runs of 8 drafts accepted


@pytest.mark.slow
def test_k8_greedy_identical_on_gguf_int4_weights(smollm2_gguf) -> None:
    """The embedded Q4_1 model: plain decode and the 9-token verify steps both run the
    checkpoint's 4-bit codes, so every greedy token is the plain engine's."""
    folder, _ = smollm2_gguf
    common = {"max_num_seqs": 2, "max_model_len": 512}
    plain = LLM(folder, **common)
    spec = LLM(folder, speculative_config=NGRAM, **common)
    layers = [m for m in spec.engine.runner.model.modules()
              if isinstance(m, SmallBatchInt4Linear)]
    assert layers and all(m.max_rows == int4_max_rows(K + 1, m.packed is not None)
                          for m in layers)
    assert all(m.max_rows >= K + 1 for m in layers)
    params = SamplingParams(temperature=0.0, max_tokens=32)
    text = ("Copy this list exactly: apples, pears, plums, cherries, grapes, lemons, "
            "limes, melons, peaches, apricots.")
    prompt = plain.tokenizer.encode_chat([{"role": "user", "content": text}],
                                         add_generation_prompt=True)
    want = plain.generate([prompt], params)[0].outputs[0].token_ids
    assert spec.generate([prompt], params)[0].outputs[0].token_ids == want
    assert spec.engine.stats().spec_num_accepted_tokens > 0
