"""On an NVIDIA GPU: CUDA graphs against eager, and hpu-serve against transformers, one run.

    python benchmarks/cuda_graphs.py --tokenizer DIR [--model DIR] [--batch-sizes 1 16 64]

Without --model it builds a random Llama at SmolLM2-135M's sizes (bf16) next to a copy of
--tokenizer (any SmolLM2 tokenizer folder): no machine here can download the real weights,
and speed does not depend on their values. Prints, per batch size:

- the decode step time with CUDA graphs and eagerly (same engine settings, rounds taken in
  turn so drift hits both alike), and their ratio;
- offline output tokens/s of hpu-serve (graphs) and of transformers ``generate`` on the same
  GPU, same token ids, EOS ignored;
- the compile / capture counters: every bucket captured at warmup, none while serving.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from execution_modes import decode_step_ms
from offline_throughput import bench_ours, make_prompts

from server import LLM

SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                    max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)


def build_random_model(folder: Path, tokenizer: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M)).to(torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    for f in tokenizer.iterdir():
        if f.is_file() and not f.name.startswith(("config", "model")):
            shutil.copy(f, folder / f.name)


def bench_hf(model, prompts: list[list[int]], new_tokens: int) -> float:
    ids = torch.tensor(prompts, device="cuda")  # equal lengths: no padding needed
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    assert out.shape[1] - ids.shape[1] == new_tokens
    return len(prompts) * new_tokens / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder (no --model)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--ctx", type=int, default=200, help="prompt tokens per sequence")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    assert torch.cuda.is_available(), "this benchmark needs an NVIDIA GPU"

    folder = Path(args.model) if args.model else Path(tempfile.mkdtemp()) / "smollm2-size"
    if args.model is None:
        assert args.tokenizer, "--tokenizer DIR is needed to build the random model"
        build_random_model(folder, Path(args.tokenizer))
    common = dict(dtype="bfloat16", max_num_seqs=max(args.batch_sizes), block_size=128,
                  max_model_len=args.ctx + args.new_tokens + args.steps + 8,
                  num_gpu_blocks_override=4096)
    start = time.perf_counter()
    graphs = LLM(str(folder), **common)
    warm_graphs = time.perf_counter() - start
    start = time.perf_counter()
    eager = LLM(str(folder), enforce_eager=True, **common)
    warm_eager = time.perf_counter() - start
    runner = graphs.engine.runner
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"mode: {runner.graphs.description}; start-up with warmup {warm_graphs:.1f} s "
          f"(eager {warm_eager:.1f} s)")

    print(f"{'batch':>5} {'graphs ms':>10} {'eager ms':>9} {'ratio':>6}")
    for bs in args.batch_sizes:
        g, e = [], []
        for r in range(args.rounds):
            order = ((graphs, g), (eager, e)) if r % 2 == 0 else ((eager, e), (graphs, g))
            for llm, times in order:
                times.append(decode_step_ms(llm, bs, args.ctx, args.steps))
        gm, em = statistics.median(g), statistics.median(e)
        print(f"{bs:>5} {gm:>10.2f} {em:>9.2f} {em / gm:>6.2f}", flush=True)

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).cuda().eval()
    bench_ours(graphs, make_prompts(graphs.tokenizer, 2, args.ctx, 0), 4)
    bench_hf(hf, make_prompts(graphs.tokenizer, 2, args.ctx, 0), 4)
    print(f"{'batch':>5} {'hpu-serve tok/s':>16} {'transformers tok/s':>19} {'ratio':>6}")
    for bs in args.batch_sizes:
        prompts = make_prompts(graphs.tokenizer, bs, args.ctx, seed=bs)
        ours = bench_ours(graphs, prompts, args.new_tokens)
        theirs = bench_hf(hf, prompts, args.new_tokens)
        print(f"{bs:>5} {ours:>16.1f} {theirs:>19.1f} {ours / theirs:>6.2f}", flush=True)

    counters = graphs.engine.counters
    print(f"compilations/captures: warmup {counters.compilations(stage='warmup')}, "
          f"serving {counters.compilations(stage='serving')}")


if __name__ == "__main__":
    main()
