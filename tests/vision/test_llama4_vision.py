"""Llama 4's vision path through the offline API against transformers on the same weights:
the tiled tower's rows (2-D rotary, pixel shuffle, adapter, projector), the tiling (tile
grids chosen by transformers' own canvas functions) and the prompt layout
(Llama4Processor's expansion), greedy answers for images of several sizes and aspect ratios
(1 to 4 tiles and a thumbnail), one and two per prompt, on every attention path (image
tokens attend causally and within the text model's chunks, as transformers' masks say),
chunked prefill that cuts between tiles, the prefix cache and the encoder cache."""

from __future__ import annotations

import pytest
import torch
from llama4_vision_helpers import (
    CHUNK,
    MAX_PATCHES,
    PER_TILE,
    TILE,
    llama4_prompt,
    reference,
    transformers_canvas,
)
from vision_helpers import random_image

from server.engine.llm import LLM
from server.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
# (width, height): wide, tall, square, small, large, very wide
SIZES = [(70, 40), (30, 100), (30, 30), (12, 9), (160, 120), (130, 20)]


def cases() -> list[tuple[str, list]]:
    images = [random_image(w, h, seed=i) for i, (w, h) in enumerate(SIZES)]
    return [
        (llama4_prompt("<|image|>the quick brown fox"), [images[0]]),
        (llama4_prompt("the lazy dog<|image|>and<|image|>numbers"), [images[1], images[2]]),
        (llama4_prompt("paged attention stores keys and values in fixed size blocks"
                       "<|image|>"), [images[3]]),
        (llama4_prompt("<|image|><|image|>"), [images[4], images[5]]),
    ]


def _tiles(folder: str, images: list, max_patches: int | None = None):
    from server.engine.multimodal.tile_processor import TiledImageProcessor
    from server.models.loader import ModelSource, load_vision_config

    cfg = load_vision_config(ModelSource(folder, None, "l4"))
    if max_patches is not None:
        cfg = cfg.with_max_patches(max_patches)
    return TiledImageProcessor(folder, cfg, 4)


def _reference(tiny, text: str, images: list, max_patches: int | None = None
               ) -> tuple[list[int], list[int]]:
    folder, model, tokenizer = tiny
    out = _tiles(folder, images, max_patches)(images) if images else None
    return reference(model, tokenizer, text, out["pixel_values"] if out else None,
                     out["aspect_ratios"] if out else [], 8)


def _generate(llm: LLM, items: list[tuple[str, list]]) -> list[list[int]]:
    outs = llm.generate([{"prompt": t, "multi_modal_data": {"image": ims}} for t, ims in items],
                        GREEDY)
    return [list(o.outputs[0].token_ids) for o in outs]


def _llm(folder: str, **options) -> LLM:
    options = {"max_num_seqs": 4, **options}
    return LLM(folder, dtype="float32", block_size=8, enforce_eager=True, max_model_len=512,
               limit_mm_per_prompt='{"image": 2}', **options)


@pytest.fixture(scope="module")
def references(tiny_llama4v) -> list[list[int]]:
    return [_reference(tiny_llama4v, t, ims)[1] for t, ims in cases()]


def test_tower_rows_equal_transformers(tiny_llama4v) -> None:
    from server.models.loader import ModelSource, load_model

    folder, model, _ = tiny_llama4v
    loaded = load_model(ModelSource(folder, None, "l4"), "float32", torch.device("cpu"))
    images = [random_image(w, h, seed=i) for i, (w, h) in enumerate(SIZES)]
    pixels = _tiles(folder, images)(images)["pixel_values"].float()
    assert pixels.shape == (5 + 5 + 1 + 1 + 5 + 5, 3, TILE, TILE)
    assert loaded.vision is not None
    with torch.no_grad():
        rows = model.get_image_features(pixels, return_dict=True).last_hidden_state
        expected = model.multi_modal_projector(rows)
        got = loaded.vision(pixels)
    assert got.shape == (len(pixels), PER_TILE, model.config.text_config.hidden_size)
    torch.testing.assert_close(got, expected)


def test_tiling_and_prompt_ids_equal_transformers(tiny_llama4v) -> None:
    """Tile grids as transformers' canvas functions choose them; the prompt as
    Llama4Processor expands it; one span per tile, exactly the ``<|patch|>`` runs, each
    with its tile's pixels (the tiles row by row, the thumbnail last)."""
    folder, model, tokenizer = tiny_llama4v
    for w, h in SIZES + [(33, 31), (300, 40), (40, 300), (64, 64), (65, 64), (1, 200)]:
        image = random_image(w, h, seed=w * h)
        ratio = _tiles(folder, [image])([image])["aspect_ratios"][0]
        assert ratio == transformers_canvas(h, w), (w, h)
    grids = set()
    for text, images in cases():
        tiler = _tiles(folder, images)
        out = tiler(images)
        grids.update(out["aspect_ratios"])
        expected, _ = reference(model, tokenizer, text, None, out["aspect_ratios"], 1)
        ids, spans = tiler.process(tokenizer(text, add_special_tokens=False)["input_ids"],
                                   images, "messages")
        assert ids == expected
        patch = model.config.image_token_id
        assert [i for i, t in enumerate(ids) if t == patch] == [
            i for s in spans for i in range(s.offset, s.end)]
        assert len(spans) == len(out["pixel_values"])
        for k, span in enumerate(spans):
            assert torch.equal(span.pixels, out["pixel_values"][k])
        assert len({s.hash for s in spans}) == len(spans)
    assert {(1, 1), (2, 2), (4, 1), (1, 4)} <= grids  # 1, 4 tiles in every shape


def test_tiles_equal_transformers_torchvision_processor(tiny_llama4v) -> None:
    """Where torchvision is installed: the prompt ids and the tiles' pixels equal
    transformers' whole Llama4Processor (AutoProcessor from the folder)."""
    pytest.importorskip("torchvision")  # transformers' Llama4ImageProcessor needs it
    from transformers import AutoProcessor

    folder, _, tokenizer = tiny_llama4v
    processor = AutoProcessor.from_pretrained(folder)
    for text, images in cases():
        enc = processor(text=text, images=images, return_tensors="pt",
                        add_special_tokens=False)
        ids, spans = _tiles(folder, images).process(
            tokenizer(text, add_special_tokens=False)["input_ids"], images, "messages")
        assert ids == enc["input_ids"][0].tolist()
        assert torch.equal(torch.stack([s.pixels for s in spans]), enc["pixel_values"])


def test_reference_depends_on_the_image(tiny_llama4v) -> None:
    """Another image, another answer (else the checks below could pass without it); and
    the text model's chunks are shorter than one tile's rows."""
    text = cases()[0][0]
    answers = {tuple(_reference(tiny_llama4v, text, [random_image(70, 40, seed=s)])[1])
               for s in range(4)}
    assert len(answers) > 1
    assert CHUNK < PER_TILE


def test_one_and_two_images_match_transformers(tiny_llama4v, references) -> None:
    llm = _llm(tiny_llama4v[0])
    assert _generate(llm, cases()) == references


def test_pytorch_ops_match_transformers(tiny_llama4v, references) -> None:
    llm = _llm(tiny_llama4v[0], environ={"HPU_SERVE_CPU_KERNELS": "0"})
    assert not llm.engine.runner.packs_tokens
    assert _generate(llm, cases()) == references


def test_chunked_prefill_between_tiles(tiny_llama4v, references) -> None:
    """A 40-token step budget: prompts run in several chunks, cut between tiles of one
    image (never inside a tile), later chunks reading the earlier tiles from the cache."""
    llm = _llm(tiny_llama4v[0], max_num_batched_tokens=40)
    cuts: list[int] = []
    runner = llm.engine.runner
    execute = runner.execute

    def spy(batch, bitmask=None):
        for row, seq in enumerate(batch.seqs):
            start, n = seq.num_computed_tokens, batch.new_tokens(row)
            for span in seq.images:
                assert not (start < span.offset < start + n < span.end), "tile cut"
                assert not (span.offset < start < span.end), "chunk starts inside a tile"
            if start and any(s.offset < start for s in seq.images) and any(
                    s.offset >= start for s in seq.images):
                cuts.append(start)
        return execute(batch, bitmask)

    runner.execute = spy
    assert _generate(llm, cases()) == references
    assert cuts  # some chunk began between two tiles of the prompt


def test_prefix_cache_keeps_images_apart_and_encoder_cache_hits(tiny_llama4v) -> None:
    llm = _llm(tiny_llama4v[0], enable_prefix_caching=True)
    text = llama4_prompt("paged attention stores keys<|image|>numbers 0 1 2")
    a, b = random_image(70, 40, seed=11), random_image(70, 40, seed=12)

    def run(prompt: str, image) -> int:
        out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": image}}, GREEDY)[0]
        assert list(out.outputs[0].token_ids) == _reference(tiny_llama4v, prompt, [image])[1]
        return out.metrics.num_cached_tokens

    patch = tiny_llama4v[1].config.image_token_id
    ids, spans = _tiles(tiny_llama4v[0], [a]).process(
        llm.engine.tokenizer.encode(text), [a], "m")
    first, last = spans[0].offset, spans[-1].end
    assert last - first > 4 * PER_TILE and ids[first] == patch
    assert run(text, a) == 0
    cached = run(text, b)  # same tokens, another image: only blocks before it are shared
    assert 0 < cached <= first
    cached = run(text, a)  # the same image again: its blocks are shared too
    assert cached >= last - 8
    encoder = llm.engine.runner.vision.cache
    hits = encoder.hits
    run(llama4_prompt("numbers<|image|>"), b)  # no shared prefix, a known image: 5 tiles
    assert encoder.hits == hits + len(spans)


def test_max_patches_from_mm_processor_kwargs(tiny_llama4v) -> None:
    """``--mm-processor-kwargs '{"max_patches": 2}'``: at most 2 tiles (and the thumbnail)
    an image, the encoder planned for 3 tiles an image; other settings refused."""
    folder = tiny_llama4v[0]
    llm = _llm(folder, max_num_seqs=1, max_num_batched_tokens=512,
               mm_processor_kwargs='{"max_patches": 2}')
    text, images = cases()[3]
    got = _generate(llm, [(text, images)])
    ratios = _tiles(folder, images, 2)(images)["aspect_ratios"]
    assert all(r * c <= 2 for r, c in ratios) and ratios != _tiles(folder, images)(images)[
        "aspect_ratios"]
    assert got == [_reference(tiny_llama4v, text, images, max_patches=2)[1]]
    assert llm.engine.runner.vision.buckets == [1, 2, 4, 6]  # 2 images of 3 tiles
    with pytest.raises(ValueError, match="'resize_to_max_canvas' is not supported"):
        _llm(folder, mm_processor_kwargs='{"resize_to_max_canvas": true}')
    assert MAX_PATCHES == 4
