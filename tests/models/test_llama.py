"""The model and paged attention against transformers' own implementation, logits level."""

from __future__ import annotations

import pytest
import torch

from server.engine.block_manager import BlockManager
from server.engine.sampling_params import SamplingParams
from server.engine.sequence import Sequence
from server.hpu.kv_cache import allocate_kv_cache
from server.models.loader import load_model, resolve_model_source

BLOCK = 8
# LongRoPE over a 64-token original context (head_dim 16: 8 factors each)
PHI3_LONGROPE = dict(rope_type="longrope", short_factor=[1.0 + i / 8 for i in range(8)],
                     long_factor=[2.0 + i / 4 for i in range(8)])


def run_prefill_then_decode(folder: str, prompts: list[list[int]], steps: int):
    """Prefill all prompts as one padded batch, then decode `steps` tokens (teacher-forced
    with the reference's tokens), returning our logits per step."""
    from server.engine.input_builder import InputBuilder
    from server.engine.model_runner import ModelForward

    loaded = load_model(resolve_model_source(folder), "float32", torch.device("cpu"))
    cfg = loaded.config
    bm = BlockManager(64, BLOCK)
    kv = allocate_kv_cache(cfg.num_layers, 64, BLOCK, cfg.num_kv_heads, cfg.head_dim,
                           torch.float32, torch.device("cpu"))
    forward = ModelForward(loaded.model, kv)
    inputs = InputBuilder(BLOCK, bm.pad_block_id, torch.device("cpu"), torch.float32)
    seqs = [Sequence(i, str(i), 0, p, SamplingParams(), 0.0) for i, p in enumerate(prompts)]
    for s in seqs:
        bm.allocate(s)
    with torch.inference_mode():
        logits = [forward(inputs.prefill(seqs))]
        for _ in range(steps):
            for s, row in zip(seqs, logits[-1]):
                s.output_token_ids.append(int(row.argmax()))
                bm.append_slot(s)
            logits.append(forward(inputs.decode(seqs)))
    return seqs, logits


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(tie=True, num_kv_heads=2),
        dict(tie=False, num_kv_heads=1),
        dict(model_type="qwen2", tie=False, num_kv_heads=2),
        dict(model_type="mistral", tie=True, num_kv_heads=4),
        dict(model_type="qwen3", tie=True, num_kv_heads=2),
        dict(model_type="granite", tie=True, num_kv_heads=2),
        dict(model_type="phi3", tie=False, num_kv_heads=2, rope_scaling=PHI3_LONGROPE),
        dict(rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                               high_freq_factor=4.0, original_max_position_embeddings=64)),
    ],
    ids=["llama-tied-gqa", "llama-untied-mqa", "qwen2-bias", "mistral-mha", "qwen3-qk-norm",
         "granite-multipliers", "phi3-longrope", "llama3-rope"],
)
def test_logits_match_transformers(tiny_model_factory, kwargs) -> None:
    folder, hf_model, _ = tiny_model_factory(**kwargs)
    gen = torch.Generator().manual_seed(1)
    vocab = hf_model.config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (3, 17, 9, 30)]
    seqs, ours = run_prefill_then_decode(folder, prompts, steps=6)
    for row, seq in enumerate(seqs):
        ids = torch.tensor([seq.all_token_ids])
        with torch.no_grad():
            ref = hf_model(ids).logits[0].float()
        n = len(prompts[row])
        for step, logits in enumerate(ours):
            torch.testing.assert_close(logits[row], ref[n - 1 + step], atol=2e-4, rtol=1e-4)
