"""Image prompts: images/s and time to first token for 1 image + 64 text tokens, at
concurrency 1 and 16, hpu-serve's engine against transformers on the same cores (CPU).

    python benchmarks/images.py [--family llava|qwen2_5_vl|gemma3] [--model FOLDER]
        [--requests 16] [--rounds 3] [--threads N] [--execution-mode auto|eager|compile]
        [--max-num-batched-tokens N]

Without ``--model`` a random model of ``--family`` (default llava) is built with the tests'
tokenizer: a 6-layer tower 256 wide and a 6-layer text model 512 wide, about 64 tokens an
image (the sizes per family, and the real checkpoints' beside them: images_families.py).
Every request carries its own image (no encoder cache hit) and generates one token, so the
time is the prefill's: processor + vision encoder + prompt. Concurrency 1: requests one at
a time, TTFT per request; concurrency 16: 16 requests at once (hpu-serve: one engine batch,
TTFT from each request's arrival to its first token; transformers: one padded batch through
``generate``). The sides alternate round by round (ours then theirs, then theirs then
ours...), so a noisy host's load falls on both; prints each side's median images/s and mean
TTFT (p50 over each round's requests, and their mean) over the rounds, and their ratios,
with the host's load average before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.images_families import Family, Transformers, build  # noqa: E402
from server import LLM, SamplingParams  # noqa: E402

TEXT_TOKENS = 64


def images(count: int, seed: int) -> list:
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray((rng.random((rng.integers(80, 400), rng.integers(80, 400), 3))
                             * 255).astype("uint8")) for _ in range(count)]


def prompt_text(tokenizer, family: Family) -> str:
    """The image's placeholder, then text of exactly TEXT_TOKENS tokens."""
    words = ("the quick brown fox jumps over the lazy dog " * 40).split()
    text = ""
    for word in words:
        candidate = (text + " " + word).strip()
        if len(tokenizer.encode(candidate, add_special_tokens=False)) > TEXT_TOKENS:
            break
        text = candidate
    return family.placeholder + text


Result = tuple[float, float, float]  # images/s, TTFT p50 s, TTFT mean s


def run_ours(llm: LLM, text: str, batches: list[list]) -> Result:
    """(images/s, TTFT p50 s, mean TTFT s) over the batches, each submitted at once."""
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    ttfts: list[float] = []
    began = time.perf_counter()
    for batch in batches:
        outs = llm.generate([{"prompt": text, "multi_modal_data": {"image": image}}
                             for image in batch], params)
        ttfts += [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]
    seconds = time.perf_counter() - began
    return sum(map(len, batches)) / seconds, statistics.median(ttfts), statistics.mean(ttfts)


def run_transformers(hf: Transformers, text: str, batches: list[list]) -> Result:
    ttfts: list[float] = []
    began = time.perf_counter()
    for batch in batches:
        start = time.perf_counter()
        hf.first_token(text, batch)
        ttfts += [time.perf_counter() - start] * len(batch)
    seconds = time.perf_counter() - began
    return sum(map(len, batches)) / seconds, statistics.median(ttfts), statistics.mean(ttfts)


def load() -> str:
    return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=[f.value for f in Family], default="llava")
    parser.add_argument("--model", help="a folder of --family's model (default: a random "
                        "one built here)")
    parser.add_argument("--requests", type=int, default=16, help="images per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--execution-mode", default="auto")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="the step's token budget (default: the engine's, 512 on CPU)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    family = Family(args.family)
    folder = args.model
    if folder is None:
        folder = tempfile.mkdtemp(prefix=f"bench-{family.value}-")
        build(family, Path(folder))
    hf = Transformers(family, folder)
    llm = LLM(folder, dtype="float32", max_model_len=512, max_num_seqs=16,
              execution_mode=args.execution_mode, limit_mm_per_prompt='{"image": 1}',
              max_num_batched_tokens=args.max_num_batched_tokens)
    text = prompt_text(llm.tokenizer, family)
    # warm both once (first-call allocations, oneDNN primitives); the same first tokens
    warm = images(4, 99)
    ours = [o.outputs[0].token_ids[0] for o in llm.generate(
        [{"prompt": text, "multi_modal_data": {"image": image}} for image in warm],
        SamplingParams(temperature=0.0, max_tokens=1))]
    theirs = hf.first_token(text, warm)
    print(f"first tokens of {len(warm)} prompts: hpu-serve {ours}, transformers {theirs}")
    print(f"{family.value}, threads {torch.get_num_threads()}, {args.rounds} rounds of "
          f"{args.requests} requests per side, 1 image + {TEXT_TOKENS} text tokens, first "
          f"token only, step budget {llm.engine.limits.max_num_batched_tokens} tokens; "
          f"{load()}")
    print(f"{'concurrency':>11} {'side':>12} {'images/s':>9} {'TTFT p50':>9} {'TTFT mean':>9}"
          "  (ms)")
    for concurrency in (1, 16):
        results: dict[str, list[Result]] = {"hpu-serve": [], "transformers": []}
        for r in range(args.rounds):
            pics = images(args.requests, seed=1000 * concurrency + r)
            batches = [pics[i:i + concurrency] for i in range(0, len(pics), concurrency)]
            sides = [("hpu-serve", lambda b=batches: run_ours(llm, text, b)),
                     ("transformers", lambda b=batches: run_transformers(hf, text, b))]
            for side, run in (sides if r % 2 == 0 else sides[::-1]):
                results[side].append(run())
        medians = {side: tuple(statistics.median(x[i] for x in got) for i in range(3))
                   for side, got in results.items()}
        for side, (rate, p50, mean) in medians.items():
            print(f"{concurrency:>11} {side:>12} {rate:>9.2f} {p50 * 1e3:>9.1f} "
                  f"{mean * 1e3:>9.1f}")
        ours, theirs = medians["hpu-serve"], medians["transformers"]
        print(f"{concurrency:>11} {'ratio':>12} {ours[0] / theirs[0]:>8.2f}x "
              f"{theirs[1] / ours[1]:>8.2f}x {theirs[2] / ours[2]:>8.2f}x  (images/s "
              "ours/theirs, TTFT theirs/ours)")
    print(load())


if __name__ == "__main__":
    main()
