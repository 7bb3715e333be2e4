"""Tensor parallelism on this host: step times at --tensor-parallel-size 1 and 2, and the
share of a step rank 0 spends in collectives.

    python benchmarks/tensor_parallel.py [--model PATH] [--sizes 1 2] [--batch-sizes 1 8]

Without --model it measures a random Llama of SmolLM2-135M's shape (30 layers, hidden 576,
MLP 1536, vocabulary 49152) but with 8 query / 2 KV heads: SmolLM2's own 9 heads split
over 1 or 3 ranks only (``--model`` unset and ``--sizes 1 3`` would need the real one:
pass ``--model smollm2`` for it).

For each size, one engine (rank 0 in this process, the other ranks spawned): the median
wall time of a prefill step (--batch-sizes[-1] prompts of --ctx tokens) and of decode steps
at each batch size; with more than one rank, the time rank 0 spends inside the forward's
all-reduces and logits gathers, and in broadcasting each step's inputs to the workers, as
a share of the step. Rank 0's time in a collective includes waiting for the slowest rank,
so on an oversubscribed host that share is load imbalance as much as transfer.
On CPU the ranks split the cores (2 cores: 1 thread per rank at size 2); the numbers say
what the communication costs, not that CPU tensor parallelism pays.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from server.config import make_engine_config
from server.engine.llm_engine import LLMEngine
from server.engine.sampling_params import SamplingParams
from server.log import init_logging


def smollm2_shaped_model() -> str:
    """A random SmolLM2-sized Llama whose heads split in two, saved to a temp folder with
    SmolLM2's tokenizer."""
    import torch
    import transformers

    from server.engine.tokenizer import Tokenizer
    from server.models.loader import resolve_model_source

    folder = Path(tempfile.mkdtemp(prefix="tp-bench-"))
    source = resolve_model_source(None)
    tokenizer = Tokenizer.from_model_path(source.folder, gguf_file=source.gguf_file,
                                          cache_dir=folder / "tokenizer-cache")
    config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=8, num_key_value_heads=2, head_dim=72,
        max_position_embeddings=2048, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    tokenizer.hf.save_pretrained(folder)
    return str(folder)


def timed_steps(engine: LLMEngine, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times


def measure(engine: LLMEngine, bs: int, ctx: int, steps: int) -> tuple[float, float, dict]:
    """(prefill step s, median decode step s, comm shares) for ``bs`` sequences."""
    stats = engine.executor.parallel.stats if engine.executor is not None else None
    params = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
    for i in range(bs):
        engine.add_request(f"b{bs}-{i}-{time.monotonic()}", [7 + i] * ctx, params)
    if stats is not None:
        stats.enabled = True
        stats.reset()
    start = time.perf_counter()
    while engine.scheduler.waiting:
        engine.step()  # the prefills (one step when they fit the token budget)
    prefill = time.perf_counter() - start
    shares = {}
    if stats is not None:
        shares["prefill"] = (stats.seconds / prefill, stats.broadcast_seconds / prefill)
        stats.reset()
    times = timed_steps(engine, steps)
    if stats is not None:
        total = sum(times)
        shares["decode"] = (stats.seconds / total, stats.broadcast_seconds / total,
                            stats.calls / steps)
        stats.enabled = False
    while engine.has_unfinished_requests():
        engine.step()
    return prefill, statistics.median(times), shares


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--ctx", type=int, default=128, help="prompt tokens per sequence")
    parser.add_argument("--steps", type=int, default=24)
    args = parser.parse_args()
    init_logging("WARNING")
    model = {None: smollm2_shaped_model, "smollm2": lambda: None}.get(
        args.model, lambda: args.model)()
    rows = []
    load = os.getloadavg()
    for size in args.sizes:
        config = make_engine_config(model=model, dtype=args.dtype,
                                    tensor_parallel_size=size, block_size=16,
                                    max_num_seqs=max(args.batch_sizes),
                                    max_model_len=args.ctx + args.steps + 16)
        engine = LLMEngine(config)
        try:
            engine.warmup()
            measure(engine, 1, 16, 4)  # first-touch costs out of the way
            for bs in args.batch_sizes:
                rows.append((size, bs, *measure(engine, bs, args.ctx, args.steps)))
        finally:
            engine.shutdown()
    print(f"\nload average before/after: {load[0]:.1f} / {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} cores")
    print(f"{'TP':>3} {'bs':>3} {'prefill ms':>11} {'decode ms':>10} "
          f"{'prefill comm':>13} {'decode comm':>12} {'decode bcast':>13} {'coll/step':>10}")
    for size, bs, prefill, decode, shares in rows:
        if shares:
            p_comm, _ = shares["prefill"]
            d_comm, d_bcast, calls = shares["decode"]
            extra = f"{p_comm:13.0%} {d_comm:12.0%} {d_bcast:13.0%} {calls:10.0f}"
        else:
            extra = f"{'-':>13} {'-':>12} {'-':>13} {'-':>10}"
        print(f"{size:>3} {bs:>3} {prefill * 1000:11.1f} {decode * 1000:10.1f} {extra}")
    base = {bs: decode for size, bs, _, decode, _ in rows if size == args.sizes[0]}
    for size, bs, _, decode, _ in rows:
        if size != args.sizes[0]:
            print(f"TP{size} / TP{args.sizes[0]} decode step time at bs {bs}: "
                  f"{decode / base[bs]:.2f}x")


if __name__ == "__main__":
    main()
