"""Decode step time of a Gemma-3-shaped model (sliding windows on 5 of 6 layers, heads of
256, GeGLU, float32 norm weights) on the fused CPU kernels against PyTorch layer ops, in one
run: the attention variants the kernels used to hand to PyTorch.

    python benchmarks/kernel_variants.py [--batch-sizes 1 16] [--ctx 1024] [--kv-cache-dtypes auto fp8]

Random bf16 weights at Gemma 3 270M's layer sizes (hidden 640, 18 layers, 4 query heads and
1 KV head of 256, MLP 2048, windows of 512) with SmolLM2's tokenizer and vocabulary (49k, not
Gemma's 262k: the LM head would otherwise dominate both sides alike). Contexts past the
window, so windowed layers really skip blocks. Each line is the median step over --rounds
rounds taken in turn (kernels, PyTorch, then PyTorch, kernels...), with the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from execution_modes import decode_step_ms  # noqa: E402

from server import LLM  # noqa: E402


def gemma3_shaped_model(window: int) -> str:
    import torch
    import transformers

    from server.engine.tokenizer import Tokenizer
    from server.models.loader import resolve_model_source

    folder = Path(tempfile.mkdtemp(prefix="kernel-variants-"))
    source = resolve_model_source(None)
    tokenizer = Tokenizer.from_model_path(source.folder, gguf_file=source.gguf_file,
                                          cache_dir=folder / "tokenizer-cache")
    config = transformers.Gemma3TextConfig(
        vocab_size=49152, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
        sliding_window=window, sliding_window_pattern=6, rope_theta=1_000_000.0,
        rope_local_base_freq=10_000.0, max_position_embeddings=32768,
        bos_token_id=tokenizer.hf.bos_token_id, eos_token_id=tokenizer.hf.eos_token_id)
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.hf.save_pretrained(folder)
    return str(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--ctx", type=int, default=1024, help="prompt tokens per sequence")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--kv-cache-dtypes", nargs="+", default=["auto", "fp8"])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    folder = gemma3_shaped_model(args.window)
    max_len = args.ctx + args.steps + 16
    for kv_dtype in args.kv_cache_dtypes:
        llms = {}
        for name, flag in (("kernels", "1"), ("pytorch", "0")):
            llms[name] = LLM(folder, dtype="bfloat16", max_model_len=max_len,
                             max_num_seqs=max(args.batch_sizes), kv_cache_dtype=kv_dtype,
                             environ={"HPU_SERVE_CPU_KERNELS": flag})
            ops = llms[name].engine.runner.model.layers[0].self_attn.ops.name
            print(f"kv {kv_dtype}: {name} -> layer ops {ops}", flush=True)
        for bs in args.batch_sizes:
            times: dict[str, list[float]] = {name: [] for name in llms}
            for r in range(args.rounds):
                order = list(llms) if r % 2 == 0 else list(reversed(llms))
                for name in order:
                    times[name].append(decode_step_ms(llms[name], bs, args.ctx, args.steps))
            k = statistics.median(times["kernels"])
            p = statistics.median(times["pytorch"])
            print(f"gemma3-shaped bf16, kv {kv_dtype}, batch {bs}, ctx {args.ctx}: "
                  f"kernels {k:.1f} ms, PyTorch ops {p:.1f} ms per decode step "
                  f"-> kernels {p / k:.2f}x faster", flush=True)
        del llms


if __name__ == "__main__":
    main()
