"""LLaVA through the offline API (vLLM's ``multi_modal_data``) against transformers on the
same weights: images of several sizes and aspect ratios, one and two per prompt, chunked
prefill that must keep each image whole, the prefix cache keyed by image, the encoder
cache."""

from __future__ import annotations

import pytest
from vision_helpers import random_image, reference_ids

from server.engine.llm import LLM
from server.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
# (width, height): wide, tall, square, small, large
SIZES = [(70, 40), (30, 100), (30, 30), (12, 9), (160, 120)]


def cases() -> list[tuple[str, list]]:
    images = [random_image(w, h, seed=i) for i, (w, h) in enumerate(SIZES)]
    return [
        ("<|user|><image>\nthe quick brown fox</s><|assistant|>", [images[0]]),
        ("<|user|><image>\nthe lazy dog<image>\nnumbers</s><|assistant|>",
         [images[1], images[2]]),
        ("<|user|>paged attention<image>\n</s><|assistant|>", [images[3]]),
        ("<|user|><image>\n<image>\n</s><|assistant|>", [images[4], images[0]]),
    ]


def _generate(llm: LLM, items: list[tuple[str, list]]) -> list[list[int]]:
    outs = llm.generate([{"prompt": t, "multi_modal_data": {"image": ims}} for t, ims in items],
                        GREEDY)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def references(tiny_llava) -> list[list[int]]:
    _, model, processor = tiny_llava
    return [reference_ids(model, processor, t, ims, 8) for t, ims in cases()]


def test_images_change_the_answer(tiny_llava) -> None:
    """The reference itself: another image, another answer (else the checks below would
    pass with the images ignored)."""
    _, model, processor = tiny_llava
    text = cases()[0][0]
    answers = {tuple(reference_ids(model, processor, text, [random_image(40, 40, seed=s)], 8))
               for s in range(4)}
    assert len(answers) > 1


def test_one_and_two_images_match_transformers(tiny_llava, references) -> None:
    llm = LLM(tiny_llava[0], dtype="float32", block_size=8, enforce_eager=True,
              max_model_len=256, max_num_seqs=4)
    assert _generate(llm, cases()) == references


@pytest.mark.slow  # 13 s on two shared cores
def test_chunked_prefill_never_cuts_an_image(tiny_llava, references) -> None:
    """A 32-token step budget: prompts run in several chunks, each image (25 tokens) in
    one of them."""
    llm = LLM(tiny_llava[0], dtype="float32", block_size=8, enforce_eager=True,
              max_model_len=256, max_num_seqs=4, max_num_batched_tokens=32)
    seen: list[tuple[int, int]] = []
    runner = llm.engine.runner
    execute = runner.execute

    def spy(batch, bitmask=None):  # each prefill row's chunk, against its images
        for row, seq in enumerate(batch.seqs):
            start, n = seq.num_computed_tokens, batch.new_tokens(row)
            for span in seq.images:
                assert not (start < span.offset < start + n < span.end), "image cut"
                assert not (span.offset < start < span.end), "chunk starts inside an image"
                if start <= span.offset and span.end <= start + n:
                    seen.append((span.offset, span.length))
        return execute(batch, bitmask)

    runner.execute = spy
    assert _generate(llm, cases()) == references
    assert len(seen) == sum(len(ims) for _, ims in cases())


@pytest.mark.slow  # 20 s on two shared cores
def test_prefix_cache_keeps_images_apart_and_encoder_cache_hits(tiny_llava) -> None:
    _, model, processor = tiny_llava
    llm = LLM(tiny_llava[0], dtype="float32", block_size=8, enforce_eager=True,
              max_model_len=256, max_num_seqs=4, enable_prefix_caching=True)
    text = "<|user|>the quick brown fox<image>\nnumbers 0 1 2</s><|assistant|>"
    a, b = random_image(50, 40, seed=11), random_image(50, 40, seed=12)

    def run(prompt: str, image) -> tuple[list[int], int]:
        out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": image}}, GREEDY)[0]
        assert list(out.outputs[0].token_ids) == reference_ids(model, processor, prompt,
                                                               [image], 8)
        return list(out.outputs[0].token_ids), out.metrics.num_cached_tokens

    image_at = llm.engine.tokenizer.encode(text).index(processor.tokenizer.convert_tokens_to_ids(
        "<image>"))
    _, cached = run(text, a)
    assert cached == 0
    _, cached = run(text, b)  # same tokens, another image: only blocks before it are shared
    assert 0 < cached <= image_at
    _, cached = run(text, a)  # the same image again: its blocks are shared too
    assert cached > image_at + 25
    encoder = llm.engine.runner.vision.cache
    hits = encoder.hits
    run("<|user|>numbers<image>\n</s><|assistant|>", b)  # no shared prefix, a known image
    assert encoder.hits == hits + 1


@pytest.mark.slow  # 4 prompts through a cache too small for them (~15 s on two cores)
def test_preempted_image_prompts_recompute_with_their_images(tiny_llava, references) -> None:
    """A KV cache too small for every prompt at once: sequences are preempted and their
    prompts (images included) computed again, the encoder cache holding one image only
    (the others are encoded again from the pixels each sequence keeps)."""
    llm = LLM(tiny_llava[0], dtype="float32", block_size=8, enforce_eager=True,
              max_model_len=128, max_num_seqs=4, num_gpu_blocks_override=16,
              environ={"HPU_SERVE_ENCODER_CACHE_IMAGES": "1"})
    assert _generate(llm, cases()) == references
    assert llm.engine.scheduler.num_preemptions > 0
