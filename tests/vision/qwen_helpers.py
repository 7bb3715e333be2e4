"""A tiny random Qwen2.5-VL built here: its vision tower (3-D patches, 2-D rotary, window
attention with full-attention blocks, the 2 x 2 merger) and a Qwen2 text model with M-RoPE,
saved with its Pillow image processor (dynamic resolution: 256 to 4096 pixels, 4-pixel
patches, so an image becomes 4 to 64 tokens) and a tokenizer whose chat template writes
Qwen's ``<|vision_start|><|image_pad|><|vision_end|>``. The reference is transformers'
greedy generation on the same weights, the prompt expanded as Qwen's processor expands it
(that processor itself wants torchvision for its video half)."""

from __future__ import annotations

from pathlib import Path

import torch

QWEN_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for p in m['content'] %}{% if p['type'] == 'image' or p['type'] == 'image_url' %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
MIN_PIXELS, MAX_PIXELS = 256, 4096


class QwenReference:
    """transformers' Qwen2_5_VLForConditionalGeneration with its image processor and
    tokenizer."""

    def __init__(self, model, image_processor, tokenizer) -> None:
        self.model = model
        self.image_processor = image_processor
        self.tokenizer = tokenizer

    def ids(self, text: str, images: list, max_new_tokens: int) -> list[int]:
        """The greedy continuation of ``text`` whose ``<|image_pad|>`` tokens stand for
        ``images`` in order."""
        pad = "<|image_pad|>"
        enc = self.image_processor(images, return_tensors="pt") if images else None
        if enc is not None:
            pieces = text.split(pad)
            assert len(pieces) == len(images) + 1
            grids = enc["image_grid_thw"].tolist()
            text = pieces[0] + "".join(pad * (t * h * w // 4) + rest
                                       for (t, h, w), rest in zip(grids, pieces[1:]))
        ids = torch.tensor([self.tokenizer.encode(text)])
        extra = {}
        if enc is not None:
            image_id = self.model.config.image_token_id
            extra = dict(pixel_values=enc["pixel_values"], image_grid_thw=enc["image_grid_thw"],
                         mm_token_type_ids=(ids == image_id).int())
        with torch.no_grad():
            out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                      max_new_tokens=max_new_tokens, do_sample=False,
                                      min_new_tokens=max_new_tokens, **extra)
        return out[0, ids.shape[1]:].tolist()

    def with_bounds(self, min_pixels: int, max_pixels: int) -> QwenReference:
        """The same model, its processor's resize bounds changed (--mm-processor-kwargs)."""
        import transformers

        ip = self.image_processor
        return QwenReference(self.model, transformers.Qwen2VLImageProcessorPil(
            min_pixels=min_pixels, max_pixels=max_pixels, patch_size=ip.patch_size,
            temporal_patch_size=ip.temporal_patch_size, merge_size=ip.merge_size),
            self.tokenizer)

    def text(self, prompt: str, images: list, max_new_tokens: int) -> str:
        return self.tokenizer.decode(self.ids(prompt, images, max_new_tokens),
                                     skip_special_tokens=True)


def save_tiny_qwen25vl(path: Path, seed: int = 0) -> QwenReference:
    import transformers

    from tests.conftest import build_tokenizer

    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": [
        "<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]})
    tok.chat_template = QWEN_TEMPLATE
    # windows of 2 x 2 merged tokens (16 pixels): images above 16 x 16 pixels span several
    vision = dict(depth=4, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2, window_size=16,
                  fullatt_block_indexes=[1, 3], out_hidden_size=64, in_channels=3)
    # M-RoPE over a 16-wide head: 2 temporal, 3 height, 3 width frequencies
    text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=512,
                rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                                 "rope_theta": 10000.0},
                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    ids = {name: tok.convert_tokens_to_ids(f"<|{name}|>")
           for name in ("image_pad", "video_pad", "vision_start", "vision_end")}
    config = transformers.Qwen2_5_VLConfig(
        vision_config=vision, text_config=text, image_token_id=ids["image_pad"],
        video_token_id=ids["video_pad"], vision_start_token_id=ids["vision_start"],
        vision_end_token_id=ids["vision_end"])
    torch.manual_seed(seed)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config).eval()
    with torch.no_grad():  # larger weights: greedy choices are not coin flips, and the
        for p in model.parameters():  # image rows move the answer
            if p.dim() >= 2:
                p.mul_(3.0)
    image_processor = transformers.Qwen2VLImageProcessorPil(
        min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=4, temporal_patch_size=2,
        merge_size=2)
    model.save_pretrained(path)
    image_processor.save_pretrained(path)
    tok.save_pretrained(path)
    return QwenReference(model, image_processor, tok)
