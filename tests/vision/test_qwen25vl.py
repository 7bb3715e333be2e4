"""Qwen2.5-VL against transformers on the same tiny random weights: the vision tower on
packed, padded images, M-RoPE positions against transformers' get_rope_index, greedy text
through the offline API for images of several sizes and aspect ratios (one and two per
prompt, text-only too), chunked prefill keeping each image whole, the prefix cache keyed by
image, and the encoder cache."""

from __future__ import annotations

import pytest
import torch
from qwen_helpers import IMAGE
from vision_helpers import random_image

from server.engine.llm import LLM
from server.engine.multimodal.inputs import ImageSpan
from server.engine.multimodal.mrope import mrope_delta, mrope_positions
from server.engine.sampling_params import SamplingParams
from server.models.vision import vision_config_of
from server.models.vision.qwen2_5_vl import QwenVision, load_vision, pack_images, vision_tensor_name

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
# (width, height): wide, tall, square at the top bound, tiny (scaled up to the lower bound),
# large (scaled down to the upper bound)
SIZES = [(70, 40), (30, 100), (64, 64), (12, 9), (160, 120)]


def cases() -> list[tuple[str, list]]:
    images = [random_image(w, h, seed=i) for i, (w, h) in enumerate(SIZES)]
    return [
        (f"<|user|>{IMAGE}the quick brown fox</s><|assistant|>", [images[0]]),
        (f"<|user|>{IMAGE}the lazy dog{IMAGE}numbers</s><|assistant|>", [images[1], images[2]]),
        (f"<|user|>paged attention{IMAGE}</s><|assistant|>", [images[3]]),
        (f"<|user|>{IMAGE}{IMAGE}</s><|assistant|>", [images[4], images[0]]),
        ("<|user|>the quick brown fox</s><|assistant|>", []),
    ]


def _generate(llm: LLM, items: list[tuple[str, list]]) -> list[list[int]]:
    prompts = [{"prompt": t, "multi_modal_data": {"image": ims}} if ims else t
               for t, ims in items]
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY)]


@pytest.fixture(scope="module")
def references(tiny_qwen25vl) -> list[list[int]]:
    ref = tiny_qwen25vl[1]
    return [ref.ids(t, ims, 8) for t, ims in cases()]


def test_images_change_the_answer(tiny_qwen25vl) -> None:
    """The reference itself: another image, another answer (else the checks below would
    pass with the images ignored)."""
    ref = tiny_qwen25vl[1]
    text = cases()[0][0]
    answers = {tuple(ref.ids(text, [random_image(40, 40, seed=s)], 4)) for s in range(3)}
    assert len(answers) > 1


def test_tower_packs_padded_images_as_transformers_encodes_them(tiny_qwen25vl) -> None:
    """Four images of other sizes in one padded call (window and image ids as masks) give
    transformers' per-image features."""
    ref = tiny_qwen25vl[1]
    hf = ref.model
    cfg = vision_config_of(hf.config)
    tower = QwenVision(cfg)
    load_vision(tower, {vision_tensor_name(n): t for n, t in hf.state_dict().items()
                        if vision_tensor_name(n) is not None}, "test")
    images = [random_image(w, h, seed=i) for i, (w, h) in enumerate(SIZES[:4])]
    enc = ref.image_processor(images, return_tensors="pt")
    grids = enc["image_grid_thw"]
    with torch.no_grad():
        expected = hf.model.get_image_features(enc["pixel_values"], grids).pooler_output
        pixels = torch.split(enc["pixel_values"], grids.prod(-1).tolist())
        packed = pack_images(cfg, pixels, [(t, h // 2, w // 2) for t, h, w in grids.tolist()],
                             size=int(grids.prod(-1).sum()) + 96)
        got = torch.split(tower(*packed.inputs)[:sum(packed.rows)], list(packed.rows))
    assert len(got) == len(expected) == 4
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_mrope_positions_match_get_rope_index(tiny_qwen25vl) -> None:
    """Text, an image, text, another image, text: each token's (t, h, w) position and the
    decode delta as transformers computes them."""
    hf = tiny_qwen25vl[1].model
    image_id = hf.config.image_token_id
    layout = [(3, None), (2, (1, 3, 5)), (4, None), (0, (1, 4, 2)), (2, None)]
    ids: list[int] = []
    spans: list[ImageSpan] = []
    grids = []
    for text, grid in layout:
        ids += [5] * text
        if grid is not None:
            t, h, w = grid
            spans.append(ImageSpan(len(ids), t * h * w, b"", grid=grid))
            ids += [image_id] * (t * h * w)
            grids.append([t, 2 * h, 2 * w])
    input_ids = torch.tensor([ids])
    expected, delta = hf.model.get_rope_index(
        input_ids, (input_ids == image_id).int(), image_grid_thw=torch.tensor(grids))
    got = mrope_positions(spans, torch.arange(len(ids)))
    assert torch.equal(got, expected[:, 0])
    assert mrope_delta(spans) == int(delta)
    # a decode past the prompt: its index plus the delta on all three axes
    assert mrope_positions(spans, torch.tensor([len(ids) + 3]))[:, 0].tolist() == \
        [len(ids) + 3 + int(delta)] * 3


def test_one_and_two_images_match_transformers(tiny_qwen25vl, references) -> None:
    llm = LLM(tiny_qwen25vl[0], dtype="float32", block_size=8, enforce_eager=True,
              max_model_len=256, max_num_seqs=4)
    assert _generate(llm, cases()) == references


@pytest.mark.slow  # 12 s on two shared cores
def test_chunked_prefill_keeps_images_whole(tiny_qwen25vl, references) -> None:
    """A 72-token step budget: the two-image prompts run in several chunks (M-RoPE
    positions continuing across them), each image in one."""
    llm = LLM(tiny_qwen25vl[0], dtype="float32", block_size=8, enforce_eager=True,
              max_model_len=256, max_num_seqs=4, max_num_batched_tokens=72)
    chunks: list[int] = []
    runner = llm.engine.runner
    execute = runner.execute

    def spy(batch, bitmask=None):
        for row, seq in enumerate(batch.seqs):
            start, n = seq.num_computed_tokens, batch.new_tokens(row)
            for span in seq.images:
                assert not (start < span.offset < start + n < span.end), "image cut"
            if n > 1 and start > 0:
                chunks.append(start)
        return execute(batch, bitmask)

    runner.execute = spy
    assert _generate(llm, cases()) == references
    assert chunks, "no prompt ran in several chunks"


@pytest.mark.slow  # 15 s on two shared cores
def test_prefix_cache_keeps_images_apart_and_encoder_cache_hits(tiny_qwen25vl) -> None:
    ref = tiny_qwen25vl[1]
    llm = LLM(tiny_qwen25vl[0], dtype="float32", block_size=8, enforce_eager=True,
              max_model_len=256, max_num_seqs=4, enable_prefix_caching=True)
    text = f"<|user|>the quick brown fox{IMAGE}numbers 0 1 2</s><|assistant|>"
    a, b = random_image(50, 40, seed=11), random_image(50, 40, seed=12)

    def run(prompt: str, image) -> int:
        out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": image}}, GREEDY)[0]
        assert list(out.outputs[0].token_ids) == ref.ids(prompt, [image], 8)
        return out.metrics.num_cached_tokens

    image_at = llm.engine.tokenizer.encode(text).index(ref.model.config.image_token_id)
    assert run(text, a) == 0
    cached = run(text, b)  # same tokens, another image: only blocks before it are shared
    assert 0 < cached <= image_at
    assert run(text, a) > image_at + 24  # the same image again: its blocks too
    encoder = llm.engine.runner.vision.cache
    hits = encoder.hits
    run(f"<|user|>numbers{IMAGE}</s><|assistant|>", b)  # no shared prefix, a known image
    assert encoder.hits == hits + 1


def test_buckets_command_prints_the_patch_buckets(tiny_qwen25vl, capsys) -> None:
    """``hpu-serve buckets MODEL``: patch buckets from the processor's pixel bounds, which
    --mm-processor-kwargs overrides (64 to 512 patches: 16 to 32 tokens an image, two
    sequences of two images, a 128-token step)."""
    from server.cli import main

    args = ["buckets", tiny_qwen25vl[0], "--max-model-len", "256", "--max-num-seqs", "2",
            "--max-num-batched-tokens", "128", "--limit-mm-per-prompt", '{"image": 2}']
    assert main(args + ["--mm-processor-kwargs",
                        '{"min_pixels": 1024, "max_pixels": 2048}']) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == ("Generated 4 encoder buckets [patches per call] (images of 16 to 32 "
                    "tokens of 4 patches, packed into one call, padded to the bucket): "
                    "[64, 128, 256, 512]")
    assert main(args) == 0  # the checkpoint's own bounds: 256 to 4096 pixels
    assert "images of 4 to 64 tokens" in capsys.readouterr().out


def test_processor_kwargs_bound_the_images(tiny_qwen25vl) -> None:
    """--mm-processor-kwargs: Qwen2.5-VL takes min_pixels / max_pixels (refusing other
    settings and bad values at start-up); the patch buckets double up to the most."""
    from server.hpu.buckets.encoder import patch_buckets
    from server.models.loader import load_vision_config, resolve_model_source
    from server.models.vision import with_processor_kwargs

    cfg = load_vision_config(resolve_model_source(tiny_qwen25vl[0]))
    assert (cfg.min_pixels, cfg.max_pixels) == (256, 4096)  # its preprocessor_config.json
    assert cfg.token_bounds() == (4, 64)
    bounded = with_processor_kwargs(cfg, {"min_pixels": 1024, "max_pixels": 2048})
    assert bounded.token_bounds() == (16, 32)
    for bad, words in (({"fps": 2}, "not supported"), ({"max_pixels": 0}, ">= 1"),
                       ({"min_pixels": 8192}, "above max_pixels")):
        with pytest.raises(ValueError, match=words):
            with_processor_kwargs(cfg, bad)
    assert patch_buckets(16, 1024, 4) == [16, 32, 64, 128, 256, 512, 1024]
    assert patch_buckets(20, 100, 4) == [32, 64, 100]
