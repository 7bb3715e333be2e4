"""Helpers of the vision tests: a tiny random LLaVA built here (CLIP vision tower + projector + Llama text model), saved
with its processor (CLIP's Pillow image processor, a tokenizer with an ``<image>`` token and
a chat template that writes it), and transformers' greedy answers as the reference."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
import torch

# the test tokenizer's roles, with image parts: "<image>\n" where each image goes
VISION_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for p in m['content'] %}{% if p['type'] == 'image' %}<image>\n"
    "{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
IMAGE_SIZE = 30  # the processor resizes and crops every image to 30 x 30 pixels
PATCH = 6  # 25 patches: 25 image tokens


def save_tiny_llava(path: Path, seed: int = 0):
    """(HF model, processor) of a random LLaVA saved to ``path``."""
    import transformers

    from tests.conftest import build_tokenizer

    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tok.chat_template = VISION_TEMPLATE
    vision = transformers.CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        image_size=IMAGE_SIZE, patch_size=PATCH, projection_dim=32)
    text = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    config = transformers.LlavaConfig(vision_config=vision, text_config=text,
                                      image_token_id=tok.convert_tokens_to_ids("<image>"))
    torch.manual_seed(seed)
    model = transformers.LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():  # larger weights: greedy choices are not coin flips, and the
        for p in model.parameters():  # image rows move the answer
            if p.dim() >= 2:
                p.mul_(3.0)
    image_processor = transformers.CLIPImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    processor = transformers.LlavaProcessor(
        image_processor=image_processor, tokenizer=tok, patch_size=PATCH,
        vision_feature_select_strategy="default", num_additional_image_tokens=1,
        chat_template=VISION_TEMPLATE)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return model, processor


def random_image(width: int, height: int, seed: int):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((height, width, 3)) * 255).astype("uint8"))


def data_uri(image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    mime = {"PNG": "png", "JPEG": "jpeg", "WEBP": "webp"}[fmt]
    return f"data:image/{mime};base64," + base64.b64encode(buf.getvalue()).decode()


def reference_ids(model, processor, text: str, images: list, max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation of ``text`` with ``images``."""
    enc = processor(text=text, images=images, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                             min_new_tokens=max_new_tokens)
    return out[0, enc["input_ids"].shape[1]:].tolist()
