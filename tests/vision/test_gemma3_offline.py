"""Gemma 3 through the offline API against transformers on the same weights: the SigLIP
tower and pooling projector's rows, the processor's prompt expansion (blank lines merged
as Gemma's tokenizer merges them), greedy answers for images of several sizes and aspect
ratios, one and two per prompt, with the bidirectional attention among an image's tokens
on every attention path (the fused CPU kernels' masked fallback, PyTorch's ops, chunked
prefill, a prefix-cache hit that ends inside an image), and pan-and-scan refused."""

from __future__ import annotations

import pytest
import torch
from gemma3_helpers import MM_TOKENS, WINDOW, causal_reference_ids, gemma3_prompt
from vision_helpers import random_image, reference_ids

from server.engine.llm import LLM
from server.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
# (width, height): wide, tall, square, small, large
SIZES = [(70, 40), (30, 100), (30, 30), (12, 9), (160, 120)]


def cases() -> list[tuple[str, list]]:
    images = [random_image(w, h, seed=i) for i, (w, h) in enumerate(SIZES)]
    return [
        (gemma3_prompt("<start_of_image>the quick brown fox"), [images[0]]),
        (gemma3_prompt("the lazy dog<start_of_image>and<start_of_image>numbers"),
         [images[1], images[2]]),
        (gemma3_prompt("paged attention stores keys and values in fixed size blocks"
                       "<start_of_image>"), [images[3]]),
        (gemma3_prompt("<start_of_image><start_of_image>"), [images[4], images[0]]),
    ]


def _generate(llm: LLM, items: list[tuple[str, list]]) -> list[list[int]]:
    outs = llm.generate([{"prompt": t, "multi_modal_data": {"image": ims}} for t, ims in items],
                        GREEDY)
    return [list(o.outputs[0].token_ids) for o in outs]


def _llm(folder: str, **options) -> LLM:
    return LLM(folder, dtype="float32", block_size=8, enforce_eager=True, max_model_len=256,
               max_num_seqs=4, **options)


@pytest.fixture(scope="module")
def references(tiny_gemma3) -> list[list[int]]:
    _, model, processor = tiny_gemma3
    return [reference_ids(model, processor, t, ims, 8) for t, ims in cases()]


def test_reference_depends_on_the_image_and_its_bidirectional_mask(tiny_gemma3,
                                                                   references) -> None:
    """The reference itself: another image, another answer; and a causal mask over the
    image tokens gives other answers (else the checks below could pass without either)."""
    _, model, processor = tiny_gemma3
    text = cases()[0][0]
    answers = {tuple(reference_ids(model, processor, text, [random_image(40, 40, seed=s)], 8))
               for s in range(4)}
    assert len(answers) > 1
    causal = [causal_reference_ids(model, processor, t, ims, 8) for t, ims in cases()]
    assert causal != references
    # the sliding layers' window is shorter than an image with its markers
    assert model.config.text_config.sliding_window == WINDOW < MM_TOKENS + 2


def test_tower_rows_and_prompt_expansion_equal_transformers(tiny_gemma3) -> None:
    from server.engine.multimodal.processor import ImageInputProcessor
    from server.models.loader import ModelSource, load_model
    from server.models.vision import vision_config_of

    folder, model, processor = tiny_gemma3
    loaded = load_model(ModelSource(folder, None, "g"), "float32", torch.device("cpu"))
    images = [random_image(w, h, seed=i) for i, (w, h) in enumerate(SIZES)]
    pixels = processor.image_processor(images, return_tensors="pt")["pixel_values"]
    assert loaded.vision is not None
    with torch.no_grad():
        expected = model.model.get_image_features(pixels, return_dict=True).pooler_output
        torch.testing.assert_close(loaded.vision(pixels), expected)
    expand = ImageInputProcessor(folder, vision_config_of(model.config), 4)
    tokenizer = processor.tokenizer
    for text, ims in cases() + [(gemma3_prompt("a\n<start_of_image>\nb"), [images[2]])]:
        enc = processor(text=text, images=ims, return_tensors="pt")
        ids, spans = expand.process(tokenizer(text)["input_ids"], ims, "messages")
        assert ids == enc["input_ids"][0].tolist()
        # each span is exactly a run of transformers' image token type
        kinds = enc["token_type_ids"][0].tolist()
        assert [i for i, k in enumerate(kinds) if k] == [
            i for s in spans for i in range(s.offset, s.end)]
        for k, span in enumerate(spans):
            assert torch.equal(span.pixels, enc["pixel_values"][k])
    # the processor's "\n\n" before an image after the template's "\n": one token
    assert "\n\n\n" in tokenizer.convert_ids_to_tokens(ids)


def test_one_and_two_images_match_transformers(tiny_gemma3, references) -> None:
    """Eager CPU with the fused kernels: steps whose chunks hold image tokens take the
    masked PyTorch path (the kernel's rows see a causal prefix only)."""
    llm = _llm(tiny_gemma3[0])
    # on the CPU, the fused kernels' packed layout is in use
    assert llm.engine.runner.packs_tokens or torch.cuda.is_available()
    assert _generate(llm, cases()) == references


@pytest.mark.slow  # 12 s on two shared cores
def test_pytorch_ops_match_transformers(tiny_gemma3, references) -> None:
    llm = _llm(tiny_gemma3[0], environ={"HPU_SERVE_CPU_KERNELS": "0"})
    assert not llm.engine.runner.packs_tokens
    assert _generate(llm, cases()) == references


@pytest.mark.slow  # 15 s on two shared cores
def test_chunked_prefill_keeps_each_image_in_one_chunk(tiny_gemma3, references) -> None:
    """A 24-token step budget: prompts run in several chunks (after the first, the
    queries read their context from the cache), each image's 16 tokens in one of them."""
    llm = _llm(tiny_gemma3[0], max_num_batched_tokens=24)
    seen: list[tuple[int, int]] = []
    runner = llm.engine.runner
    execute = runner.execute

    def spy(batch, bitmask=None):
        for row, seq in enumerate(batch.seqs):
            start, n = seq.num_computed_tokens, batch.new_tokens(row)
            for span in seq.images:
                assert not (start < span.offset < start + n < span.end), "image cut"
                assert not (span.offset < start < span.end), "chunk starts inside an image"
                if start <= span.offset and span.end <= start + n:
                    seen.append((span.offset, start))
        return execute(batch, bitmask)

    runner.execute = spy
    assert _generate(llm, cases()) == references
    assert len(seen) == sum(len(ims) for _, ims in cases())
    assert any(start > 0 for _, start in seen)  # some image after a cached context


@pytest.mark.slow  # 15 s on two shared cores
def test_prefix_hit_inside_an_image_computes_the_rest_of_it(tiny_gemma3) -> None:
    """Two prompts share their text up to just after an image: the second's prefix-cache
    hit ends at a block boundary inside the image, and its first chunk holds the rest of
    the image, whose tokens still see each other (and the cached ones)."""
    folder, model, processor = tiny_gemma3
    llm = _llm(folder, enable_prefix_caching=True)
    image = random_image(60, 45, seed=21)
    head = next(h for h in ("the fox", "the lazy fox", "a fox", "the quick brown fox",
                            "numbers 0 1", "paged attention")
                if _hit_inside_image(processor, h, image))

    def run(tail: str) -> tuple[list[int], int]:
        text = gemma3_prompt(f"{head}<start_of_image>{tail}")
        out = llm.generate({"prompt": text, "multi_modal_data": {"image": image}}, GREEDY)[0]
        assert list(out.outputs[0].token_ids) == reference_ids(model, processor, text,
                                                               [image], 8)
        return list(out.outputs[0].token_ids), out.metrics.num_cached_tokens

    run("numbers 0 1 2")
    start, end = _image_at(processor, head, image)
    _, cached = run("the lazy dog")
    assert start < cached < end, (start, cached, end)


def _image_at(processor, head: str, image) -> tuple[int, int]:
    kinds = processor(text=gemma3_prompt(f"{head}<start_of_image>x"), images=[image],
                      return_tensors="pt")["token_type_ids"][0].tolist()
    first = kinds.index(1)
    return first, first + sum(kinds)


def _hit_inside_image(processor, head: str, image) -> bool:
    """Whether a block boundary (8) falls inside the image and the block across it also
    holds the text after the image (the end marker, "\\n\\n", then the tail)."""
    start, end = _image_at(processor, head, image)
    boundary = end // 8 * 8
    return start < boundary < end and boundary + 8 > end + 2


def test_pan_and_scan_and_unknown_processor_settings_are_refused(tiny_gemma3) -> None:
    with pytest.raises(ValueError, match="do_pan_and_scan"):
        _llm(tiny_gemma3[0], mm_processor_kwargs='{"do_pan_and_scan": true}')
    with pytest.raises(ValueError, match="'min_pixels' is not a setting"):
        _llm(tiny_gemma3[0], mm_processor_kwargs='{"min_pixels": 3136}')
