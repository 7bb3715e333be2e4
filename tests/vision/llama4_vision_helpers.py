"""A tiny random Llama 4 vision-language model built here (transformers'
Llama4ForConditionalGeneration: the tiled vision tower with its pixel shuffle and the text
model with chunked attention in three layers of four), saved with a tokenizer carrying Llama
4's image tokens and the processor files transformers' Llama4Processor reads; and the
reference: transformers' greedy answer for the processor's prompt layout
(Llama4Processor's own expansion) and the tiles."""

from __future__ import annotations

import ast
import json
import math
from collections import defaultdict
from functools import lru_cache
from pathlib import Path

import torch

TILE = 32  # pixels a side of a tile: 8 x 8 patches of 4, shuffled into 16 rows
PATCH = 4
PER_TILE = 16
MAX_PATCHES = 4  # up to 4 tiles and a thumbnail an image
CHUNK = 8  # the text model's attention chunk: shorter than one tile's rows
IMAGE_TOKENS = ["<|image_start|>", "<|image_end|>", "<|image|>", "<|patch|>",
                "<|tile_x_separator|>", "<|tile_y_separator|>"]
# Llama 4's template, reduced: the BOS, headers, "<|image|>" per image part
LLAMA4_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|header_start|>{{ m['role'] }}<|header_end|>\n\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for p in m['content'] %}{% if p['type'] == 'image' %}<|image|>"
    "{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<|eot|>{% endfor %}"
    "{% if add_generation_prompt %}<|header_start|>assistant<|header_end|>\n\n{% endif %}"
)


def save_tiny_llama4_vision(path: Path, seed: int = 0):
    """(HF Llama4ForConditionalGeneration, tokenizer) of a random model saved to ``path``
    with its processor's files."""
    import transformers

    from tests.conftest import build_tokenizer

    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS + [
        "<|header_start|>", "<|header_end|>", "<|eot|>"]})
    tok.chat_template = LLAMA4_TEMPLATE
    ids = {t: tok.convert_tokens_to_ids(t) for t in IMAGE_TOKENS}
    vision = transformers.Llama4VisionConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
        image_size=TILE, patch_size=PATCH, pixel_shuffle_ratio=0.5, vision_output_dim=64,
        projector_input_dim=64, projector_output_dim=64, rope_theta=10000.0)
    text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=32,
                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, intermediate_size_mlp=96, num_local_experts=4,
                num_experts_per_tok=1, interleave_moe_layer_step=2,
                attention_chunk_size=CHUNK, floor_scale=4, attn_scale=0.5,
                max_position_embeddings=1024, bos_token_id=tok.bos_token_id,
                eos_token_id=tok.eos_token_id, pad_token_id=0)
    config = transformers.Llama4Config(
        vision_config=vision, text_config=text, image_token_index=ids["<|patch|>"],
        boi_token_index=ids["<|image_start|>"], eoi_token_index=ids["<|image_end|>"])
    torch.manual_seed(seed)
    model = transformers.Llama4ForConditionalGeneration(config).eval()
    with torch.no_grad():  # larger weights: greedy choices are not coin flips, and the
        for name, p in model.named_parameters():  # image rows move the answer
            if p.dim() >= 2 and "vision_model" not in name:
                p.mul_(3.0)
            elif "vision_model" in name and p.dim() >= 2:
                p.mul_(2.0)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Llama4ImageProcessor", "processor_class": "Llama4Processor",
        "size": {"height": TILE, "width": TILE}, "max_patches": MAX_PATCHES,
        "resize_to_max_canvas": False, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
        "rescale_factor": 1 / 255, "do_resize": True, "do_rescale": True,
        "do_normalize": True, "do_convert_rgb": True, "resample": 2}))
    (path / "processor_config.json").write_text(json.dumps({
        "processor_class": "Llama4Processor", "patch_size": PATCH, "pixel_shuffle_ratio": 0.5,
        "fake_image_token": "<|image|>", "image_token": "<|image|>",
        "start_of_image_token": "<|image_start|>", "end_of_image_token": "<|image_end|>",
        "patch_token": "<|patch|>", "tile_x_separator_token": "<|tile_x_separator|>",
        "tile_y_separator_token": "<|tile_y_separator|>"}))
    return model, tok


def llama4_prompt(body: str) -> str:
    """One user turn as the template writes it (``<|image|>`` where images go)."""
    return f"<s><|header_start|>user<|header_end|>\n\n{body}<|eot|><|header_start|>assistant" \
           "<|header_end|>\n\n"


def expanded_text(text: str, ratios: list[tuple[int, int]]) -> str:
    """``text`` with each ``<|image|>`` replaced by transformers' Llama4Processor layout for
    an image of ``ratios[k]`` (rows, columns) tiles."""
    from transformers import Llama4Processor

    parts = text.split("<|image|>")
    assert len(parts) == len(ratios) + 1
    out = parts[0]
    for ratio, part in zip(ratios, parts[1:]):
        # its own method (it reads nothing of the instance)
        out += Llama4Processor._prompt_split_image(None, ratio, PER_TILE) + part
    return out


def reference(model, tokenizer, text: str, pixels: torch.Tensor | None,
              ratios: list[tuple[int, int]], max_new_tokens: int) -> tuple[list[int], list[int]]:
    """(transformers' prompt ids for ``text`` with images of ``ratios`` tiles, its greedy
    continuation with the tiles ``pixels``)."""
    ids = tokenizer(expanded_text(text, ratios), add_special_tokens=False,
                    return_tensors="pt")["input_ids"]
    with torch.no_grad():
        embeds = model.get_input_embeddings()(ids)
        if pixels is not None:
            # transformers' Llama4ForConditionalGeneration.forward merge (its generate fails
            # in transformers 5.24 building its output: no image_outputs on the text
            # model's), then its language model's generate from the embeddings
            rows = model.get_image_features(pixels.float(), return_dict=True).last_hidden_state
            rows = model.multi_modal_projector(rows.reshape(-1, rows.shape[-1]))
            mask = (ids == model.config.image_token_id).unsqueeze(-1)
            assert int(mask.sum()) == rows.shape[0]
            embeds = embeds.masked_scatter(mask, rows)
        out = model.language_model.generate(
            inputs_embeds=embeds, attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False)
    return ids[0].tolist(), out[0, -max_new_tokens:].tolist()


def transformers_canvas(height: int, width: int, max_patches: int = MAX_PATCHES,
                        tile: int = TILE) -> tuple[int, int]:
    """(rows, columns) of tiles transformers' Llama4ImageProcessor picks for an image: its
    own canvas functions, read from its source (the module needs torchvision to import)."""
    import transformers.models.llama4 as pkg
    from transformers.image_utils import SizeDict

    source = Path(pkg.__file__).with_name("image_processing_llama4.py").read_text()
    wanted = {"get_factors", "find_supported_resolutions", "get_best_fit"}
    tree = ast.parse(source)
    body = [node for node in tree.body
            if isinstance(node, ast.FunctionDef) and node.name in wanted]
    space: dict = {"math": math, "torch": torch, "defaultdict": defaultdict,
                   "lru_cache": lru_cache, "SizeDict": SizeDict}
    exec(compile(ast.Module(body=body, type_ignores=[]), "image_processing_llama4", "exec"),
         space)
    options = torch.tensor(space["find_supported_resolutions"](
        max_patches, SizeDict(height=tile, width=tile)))
    canvas = space["get_best_fit"]((height, width), options)
    return int(canvas[0]) // tile, int(canvas[1]) // tile
