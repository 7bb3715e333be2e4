"""Where an engine step's host time goes: cProfile over decode steps, functions by own time.

    python benchmarks/step_profile.py [--model DIR | --tokenizer DIR] [--batch-size 1] [--steps 200]

On an accelerator a small model's decode step is bound by the host (scheduler, input
building, sampler, output processing), not by the replayed graph: this prints the median
step, then the functions that take the most of it, so the next host-side change is picked by
measurement. The time a step waits for the device shows up in the function that syncs
(``Tensor.tolist`` / ``.cpu()``), which says how much of the step the device itself takes.
Without ``--model`` it builds the random SmolLM2-size Llama of ``cuda_graphs.py`` next to
``--tokenizer`` (bf16 on CUDA; fp32 on the CPU).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import tempfile
import time
from pathlib import Path

import torch
from cuda_graphs import build_random_model

from server import LLM, SamplingParams


def profile_decode(llm: LLM, bs: int, ctx: int, steps: int) -> tuple[float, pstats.Stats]:
    """(median step ms, the profile of ``steps`` decode steps at batch ``bs``)."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True)
    for i in range(bs):
        engine.add_request(f"p{i}", [7 + i] * ctx, params)
    while any(s.num_output_tokens == 0 for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    for _ in range(3):  # steady state before timing
        engine.step()
    times: list[float] = []
    prof = cProfile.Profile()
    for _ in range(steps - 3):
        start = time.perf_counter()
        prof.enable()
        engine.step()
        prof.disable()
        times.append(time.perf_counter() - start)
    while engine.has_unfinished_requests():
        engine.step()
    return statistics.median(times) * 1000, pstats.Stats(prof, stream=io.StringIO())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder (no --model)")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--ctx", type=int, default=200)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--enforce-eager", action="store_true")
    args = parser.parse_args()

    folder = Path(args.model) if args.model else Path(tempfile.mkdtemp()) / "smollm2-size"
    if args.model is None:
        assert args.tokenizer, "--tokenizer DIR is needed to build the random model"
        build_random_model(folder, Path(args.tokenizer))
    dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    llm = LLM(str(folder), dtype=dtype, max_num_seqs=max(args.batch_size, 2), block_size=128,
              max_model_len=args.ctx + args.steps + 16, enforce_eager=args.enforce_eager)
    step_ms, stats = profile_decode(llm, args.batch_size, args.ctx, args.steps)
    print(f"device: {llm.engine.runner.graphs.description}; batch {args.batch_size}: "
          f"median step {step_ms:.2f} ms over {args.steps - 3} steps")
    stats.sort_stats("tottime").print_stats(args.top)
    print(stats.stream.getvalue())  # type: ignore[attr-defined]


if __name__ == "__main__":
    main()
