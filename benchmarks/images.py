"""Image prompts: images/s and time to first token for 1 image + 64 text tokens, at
concurrency 1 and 16, hpu-serve's engine against transformers on the same cores (CPU).

    python benchmarks/images.py [--model LLAVA_FOLDER] [--requests 16] [--rounds 3]
        [--threads N] [--execution-mode auto|eager|compile] [--max-num-batched-tokens N]

Without ``--model`` a random LLaVA is built (CLIP tower 6 x 256 wide, 112-pixel images in
14-pixel patches: 64 image tokens; Llama text model 6 x 512 wide) with the tests' tokenizer.
Every request carries its own image (no encoder cache hit) and generates one token, so the
time is the prefill's: processor + vision encoder + prompt. Concurrency 1: requests one at
a time, TTFT per request; concurrency 16: 16 requests at once (hpu-serve: one engine batch,
TTFT from each request's arrival to its first token; transformers: one padded batch through
``generate``). The sides alternate round by round (ours then theirs, then theirs then
ours...), so a noisy host's load falls on both; prints each side's median images/s and mean
TTFT over the rounds, and their ratios.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from server import LLM, SamplingParams  # noqa: E402

TEXT_TOKENS = 64


def build_llava(path: Path) -> None:
    """A random LLaVA of a size where the encoder and the prompt both cost something."""
    import transformers

    from tests.conftest import build_tokenizer

    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    vision = transformers.CLIPVisionConfig(hidden_size=256, intermediate_size=1024,
                                           num_hidden_layers=6, num_attention_heads=4,
                                           image_size=112, patch_size=14)
    text = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=512,
                                    intermediate_size=1536, num_hidden_layers=6,
                                    num_attention_heads=8, num_key_value_heads=4,
                                    max_position_embeddings=1024,
                                    bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    config = transformers.LlavaConfig(vision_config=vision, text_config=text,
                                      image_token_id=tok.convert_tokens_to_ids("<image>"))
    torch.manual_seed(0)
    transformers.LlavaForConditionalGeneration(config).save_pretrained(path)
    processor = transformers.LlavaProcessor(
        image_processor=transformers.CLIPImageProcessorPil(
            size={"shortest_edge": 112}, crop_size={"height": 112, "width": 112}),
        tokenizer=tok, patch_size=14, vision_feature_select_strategy="default",
        num_additional_image_tokens=1)
    processor.save_pretrained(path)


def images(count: int, seed: int) -> list:
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray((rng.random((rng.integers(80, 400), rng.integers(80, 400), 3))
                             * 255).astype("uint8")) for _ in range(count)]


def prompt_text(tokenizer) -> str:
    """``<image>`` then text of exactly TEXT_TOKENS tokens."""
    words = ("the quick brown fox jumps over the lazy dog " * 40).split()
    text = ""
    for word in words:
        candidate = (text + " " + word).strip()
        if len(tokenizer.encode(candidate, add_special_tokens=False)) > TEXT_TOKENS:
            break
        text = candidate
    return "<image>\n" + text


def run_ours(llm: LLM, text: str, batches: list[list]) -> tuple[float, float]:
    """(images/s, mean TTFT s) over the batches, each submitted at once."""
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    ttfts: list[float] = []
    began = time.perf_counter()
    for batch in batches:
        outs = llm.generate([{"prompt": text, "multi_modal_data": {"image": image}}
                             for image in batch], params)
        ttfts += [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]
    seconds = time.perf_counter() - began
    return sum(map(len, batches)) / seconds, statistics.mean(ttfts)


def run_transformers(model, processor, text: str, batches: list[list]) -> tuple[float, float]:
    ttfts: list[float] = []
    began = time.perf_counter()
    for batch in batches:
        start = time.perf_counter()
        enc = processor(text=[text] * len(batch), images=batch, return_tensors="pt")
        with torch.inference_mode():
            model.generate(**enc, max_new_tokens=1, do_sample=False)
        ttfts += [time.perf_counter() - start] * len(batch)
    seconds = time.perf_counter() - began
    return sum(map(len, batches)) / seconds, statistics.mean(ttfts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a LLaVA folder (default: a random one built here)")
    parser.add_argument("--requests", type=int, default=16, help="images per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--execution-mode", default="auto")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="the step's token budget (default: the engine's, 512 on CPU)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers

    folder = args.model
    if folder is None:
        folder = tempfile.mkdtemp(prefix="bench-llava-")
        build_llava(Path(folder))
    model = transformers.LlavaForConditionalGeneration.from_pretrained(
        folder, dtype=torch.float32).eval()
    processor = transformers.AutoProcessor.from_pretrained(folder)
    llm = LLM(folder, dtype="float32", max_model_len=512, max_num_seqs=16,
              execution_mode=args.execution_mode, limit_mm_per_prompt='{"image": 1}',
              max_num_batched_tokens=args.max_num_batched_tokens)
    text = prompt_text(llm.tokenizer)
    # warm both once (first-call allocations, oneDNN primitives)
    run_ours(llm, text, [images(2, 99)])
    run_transformers(model, processor, text, [images(2, 99)])
    print(f"threads {torch.get_num_threads()}, {args.rounds} rounds of {args.requests} "
          f"requests per side, 1 image + {TEXT_TOKENS} text tokens, first token only, "
          f"step budget {llm.engine.limits.max_num_batched_tokens} tokens")
    print(f"{'concurrency':>11} {'side':>12} {'images/s':>9} {'TTFT ms':>9}")
    for concurrency in (1, 16):
        results: dict[str, list[tuple[float, float]]] = {"hpu-serve": [], "transformers": []}
        for r in range(args.rounds):
            pics = images(args.requests, seed=1000 * concurrency + r)
            batches = [pics[i:i + concurrency] for i in range(0, len(pics), concurrency)]
            sides = [("hpu-serve", lambda b=batches: run_ours(llm, text, b)),
                     ("transformers", lambda b=batches: run_transformers(model, processor,
                                                                          text, b))]
            for side, run in (sides if r % 2 == 0 else sides[::-1]):
                results[side].append(run())
        medians = {side: (statistics.median(x[0] for x in got),
                          statistics.median(x[1] for x in got))
                   for side, got in results.items()}
        for side, (rate, ttft) in medians.items():
            print(f"{concurrency:>11} {side:>12} {rate:>9.2f} {ttft * 1e3:>9.1f}")
        ours, theirs = medians["hpu-serve"], medians["transformers"]
        print(f"{concurrency:>11} {'ratio':>12} {ours[0] / theirs[0]:>8.2f}x "
              f"{theirs[1] / ours[1]:>8.2f}x  (images/s ours/theirs, TTFT theirs/ours)")


if __name__ == "__main__":
    main()
