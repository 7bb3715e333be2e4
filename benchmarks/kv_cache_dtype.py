"""fp8 KV cache against the model-dtype cache: greedy agreement and memory.

    python benchmarks/kv_cache_dtype.py [--model PATH] [--prompts 32] [--tokens 64]

Runs the same greedy chat completions with ``--kv-cache-dtype auto`` (bf16 for the embedded
SmolLM2) and ``fp8``, one engine after the other, and prints the fraction of generated
tokens that agree position by position, how many completions are identical, where the others
first diverge, and the KV bytes per token of each. Agreement is not expected to be 100%:
fp8 e4m3 keeps 3 mantissa bits.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from server import LLM, SamplingParams  # noqa: E402

TOPICS = ["the ocean", "a bicycle", "volcanoes", "bread", "the moon", "chess", "rain",
          "a library", "bees", "trains", "music", "glaciers", "a garden", "coffee",
          "mountains", "the internet", "whales", "paper", "clocks", "deserts", "bridges",
          "the sun", "forests", "rivers", "cats", "maps", "snow", "castles", "robots",
          "islands", "birds", "stars"]


def run(model: str | None, kv: str, prompts: list[list[int]], tokens: int
        ) -> tuple[list[list[int]], float]:
    llm = LLM(model, kv_cache_dtype=kv, max_num_seqs=32, max_model_len=1024)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    runner = llm.engine.runner
    per_token = runner.kv_cache_bytes / ((runner.num_blocks + 1) * runner.block_size)
    return outputs, per_token


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    texts = [f"Write a few sentences about {TOPICS[i % len(TOPICS)]}."
             for i in range(args.prompts)]
    first = LLM(args.model, max_num_seqs=1, max_model_len=1024)
    prompts = [first.tokenizer.encode_chat([{"role": "user", "content": t}]) for t in texts]
    del first
    base, base_bytes = run(args.model, "auto", prompts, args.tokens)
    fp8, fp8_bytes = run(args.model, "fp8", prompts, args.tokens)
    agree = sum(x == y for a, b in zip(base, fp8) for x, y in zip(a, b))
    total = sum(map(len, base))
    identical = sum(a == b for a, b in zip(base, fp8))
    diverge = [next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
               for a, b in zip(base, fp8) if a != b]
    print(f"greedy tokens agreeing position by position: {agree}/{total} "
          f"({100.0 * agree / total:.1f}%)")
    print(f"identical completions: {identical}/{len(base)}; the others first diverge at token "
          f"{statistics.median(diverge) if diverge else '-'} (median)")
    print(f"KV bytes per token: model dtype {base_bytes:.0f}, fp8 {fp8_bytes:.0f} "
          f"(x{fp8_bytes / base_bytes:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
