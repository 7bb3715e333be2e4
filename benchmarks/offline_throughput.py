"""Offline output tokens/s of hpu-serve vs transformers `generate`, same prompts, same run.

    python benchmarks/offline_throughput.py [--batch-sizes 1 8 32] [--prompt-len 200]
        [--new-tokens 128] [--dtype auto] [--model PATH]

Prints one line per batch size with both throughputs and their ratio. Both sides generate
exactly --new-tokens tokens per prompt (EOS ignored) from the same token ids.
"""

from __future__ import annotations

import argparse
import logging
import random
import time

import torch

from server import LLM, SamplingParams
from server.models.loader import resolve_model_source

TEXT = (
    "Paged attention splits the key value cache into fixed size blocks so that sequences of "
    "different lengths can share memory without fragmentation. Continuous batching lets new "
    "requests join a running batch between steps, which keeps the accelerator busy. "
)


def make_prompts(tokenizer, count: int, length: int, seed: int) -> list[list[int]]:
    base = tokenizer.encode(TEXT * 40, add_special_tokens=False)
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        start = rng.randrange(0, len(base) - length)
        prompts.append(base[start : start + length])
    return prompts


def bench_ours(llm: LLM, prompts: list[list[int]], new_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == new_tokens for o in outs)
    return len(prompts) * new_tokens / elapsed


def bench_hf(model, prompts: list[list[int]], new_tokens: int, pad_id: int) -> float:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad_id,
        )
    elapsed = time.perf_counter() - start
    assert out.shape[1] - width == new_tokens
    return len(prompts) * new_tokens / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-len", type=int, default=200)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=max(args.batch_sizes))
    dtype = llm.engine.runner.dtype
    hf_model = None
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        source = resolve_model_source(args.model)
        hf_model = AutoModelForCausalLM.from_pretrained(
            source.folder, gguf_file=source.gguf_file, dtype=dtype
        ).eval()
    print(f"torch threads: {torch.get_num_threads()}, dtype: {dtype}, "
          f"prompt_len: {args.prompt_len}, new_tokens: {args.new_tokens}")
    bench_ours(llm, make_prompts(llm.tokenizer, 2, args.prompt_len, 0), 4)  # warm up
    print(f"{'batch':>5} {'hpu-serve tok/s':>16} {'transformers tok/s':>19} {'ratio':>6}")
    for bs in args.batch_sizes:
        prompts = make_prompts(llm.tokenizer, bs, args.prompt_len, seed=bs)
        ours = bench_ours(llm, prompts, args.new_tokens)
        theirs = (
            bench_hf(hf_model, prompts, args.new_tokens, llm.tokenizer.hf.pad_token_id or 0)
            if hf_model is not None else float("nan")
        )
        print(f"{bs:>5} {ours:>16.1f} {theirs:>19.1f} {ours / theirs:>6.2f}", flush=True)


if __name__ == "__main__":
    main()
