"""Decode step time of multi-head latent attention (DeepSeek-V3): the weight-absorbed path
that serves against the naive path that expands every cached latent, in the same run, on
the same random model, KV cache and batch (CPU).

    python benchmarks/mla_decode.py [--hidden 1024] [--layers 4] [--heads 16]
        [--kv-lora-rank 512] [--context 1024 2048] [--batch 1 8] [--steps 10]
        [--rounds 3] [--dtype float32|bfloat16] [--moe] [--threads N]

The model is a transformers DeepseekV3 config with random weights, saved to a temporary
folder and loaded by the server's loader: q through a 768-rank pair, kv_lora_rank 512,
qk_nope 128 + qk_rope 64 per head, v 128 (DeepSeek-V3's head shapes), YaRN. Its MLPs are
dense unless ``--moe`` (16 routed experts in 4 groups, top-2, one shared), so that the
attention's share of the step shows. Each sequence is prefilled to ``--context`` tokens, then
one decode step's forward (model only: no sampling, no scheduler) is timed ``--steps``
times per round, absorbed and naive alternating round by round; prints min and median step
times, the ratio, and the bytes of KV cache each token takes (the latent against what a
cache of full K/V heads would take).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from server.engine.core.block_manager import BlockManager  # noqa: E402
from server.engine.core.sequence import Sequence  # noqa: E402
from server.engine.sampling_params import SamplingParams  # noqa: E402
from server.engine.worker.input_builder import InputBuilder  # noqa: E402
from server.engine.worker.model_runner import ModelForward  # noqa: E402
from server.models.loader import load_model, resolve_model_source  # noqa: E402

BLOCK = 128


def save_model(folder: Path, args: argparse.Namespace) -> None:
    import transformers

    moe = (dict(n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=2,
                n_shared_experts=1, moe_intermediate_size=args.hidden // 2,
                first_k_dense_replace=1)
           if args.moe else dict(first_k_dense_replace=args.layers))
    config = transformers.DeepseekV3Config(
        vocab_size=2048, hidden_size=args.hidden, intermediate_size=args.hidden * 2,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.heads, kv_lora_rank=args.kv_lora_rank, q_lora_rank=768,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        max_position_embeddings=8192, num_nextn_predict_layers=0,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                             original_max_position_embeddings=2048, mscale=1.0,
                             mscale_all_dim=1.0, beta_fast=32, beta_slow=1), **moe)
    torch.manual_seed(0)
    transformers.DeepseekV3ForCausalLM(config).save_pretrained(folder)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-lora-rank", type=int, default=512)
    parser.add_argument("--context", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--moe", action="store_true")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        save_model(Path(tmp), args)
        loaded = load_model(resolve_model_source(tmp), args.dtype, torch.device("cpu"))
    model, cfg, dtype = loaded.model, loaded.config, loaded.dtype
    assert cfg.mla is not None
    layout = cfg.kv_layout
    full = 2 * cfg.num_layers * cfg.num_heads * cfg.mla.qk_head_dim * dtype.itemsize
    print(f"MLA decode, {args.dtype}, threads {torch.get_num_threads()}, hidden {args.hidden},"
          f" {args.layers} layers, {args.heads} heads, kv_lora_rank {args.kv_lora_rank}, "
          f"{'MoE' if args.moe else 'dense'} MLPs; KV cache {layout.bytes_per_token(dtype)} "
          f"bytes/token (full K/V heads would take {full})")
    for context in args.context:
        for bs in args.batch:
            blocks = bs * (-(-(context + 1) // BLOCK))
            bm = BlockManager(blocks, BLOCK)
            kv = layout.allocate(blocks, BLOCK, dtype, torch.device("cpu"))
            forward = ModelForward(model, kv)
            inputs = InputBuilder(BLOCK, bm.pad_block_id, torch.device("cpu"), dtype, 8192)
            gen = torch.Generator().manual_seed(context + bs)
            seqs = [Sequence(i, str(i), 0, torch.randint(3, 2048, (context,), generator=gen)
                             .tolist(), SamplingParams(), 0.0) for i in range(bs)]
            with torch.inference_mode():
                for s in seqs:  # one prompt at a time: the naive prefill's memory
                    bm.allocate(s)
                    forward(inputs.prefill([s]))
                    s.output_token_ids.append(1)
                    bm.append_slot(s)
                step = inputs.decode(seqs)
                times: dict[bool, list[float]] = {True: [], False: []}
                for r in range(args.rounds + 1):
                    for absorbed in (True, False) if r % 2 == 0 else (False, True):
                        for layer in model.layers:
                            layer.self_attn.absorbed_decode = absorbed
                        began = time.perf_counter()
                        for _ in range(args.steps):
                            forward(step)
                        if r:  # round 0 warms both up
                            times[absorbed].append(
                                (time.perf_counter() - began) / args.steps * 1e3)
            a, n = times[True], times[False]
            print(f"  context {context}, batch {bs}: absorbed min {min(a):.2f} ms, median "
                  f"{statistics.median(a):.2f} ms | naive min {min(n):.2f} ms, median "
                  f"{statistics.median(n):.2f} ms | naive/absorbed "
                  f"{statistics.median(n) / statistics.median(a):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
