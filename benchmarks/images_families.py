"""The random vision-language models benchmarks/images.py times, one per family, and
transformers' side of each: how a batch of (prompt, one image) pairs is processed and run to
its first token.

The sizes are the smallest real checkpoints' shapes cut down to what two shared CPU cores
time in minutes (every family alike: a 6-layer tower 256 wide, a 6-layer text model 512 wide
with 8 query and 4 KV heads of 64, about 64 tokens an image):

- llava: CLIP 6 x 256 at 112 pixels in 14-pixel patches (64 tokens), Llama 6 x 512
  (LLaVA 1.5 7B: CLIP ViT-L/14 24 x 1024 at 336 pixels, 576 tokens; Llama 32 x 4096);
- qwen2_5_vl: ViT 6 x 256, 14-pixel patches merged 2 x 2, windows of 112 pixels, full
  attention in blocks 2 and 5, at most 12,544 pixels an image (64 tokens; an aspect ratio
  keeps fewer); Qwen2 6 x 512 with M-RoPE (3B: ViT 32 x 1280, Qwen2.5 36 x 2048);
- gemma3: SigLIP 6 x 256 at 224 pixels, 256 patches pooled 2 x 2 to 64 tokens; Gemma 3
  6 x 512, five sliding layers (window 512) to one global (4B: SigLIP 27 x 1152 at 896
  pixels pooled to 256 tokens, Gemma 3 34 x 2560).
"""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Any

import torch

# the text model every family shares (head_dim 64)
TEXT = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
            num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024)
TOWER = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=4)
QWEN_MAX_PIXELS = 112 * 112  # 8 x 8 merged cells: 64 tokens
QWEN_MIN_PIXELS = 56 * 56
GEMMA_IMAGE_SIZE = 224  # 16 x 16 patches of 14 pixels, pooled to 8 x 8 = 64 tokens


class Family(enum.Enum):
    LLAVA = "llava"
    QWEN2_5_VL = "qwen2_5_vl"
    GEMMA3 = "gemma3"

    @property
    def placeholder(self) -> str:
        """What an offline prompt writes where its image goes."""
        return {Family.LLAVA: "<image>\n",
                Family.QWEN2_5_VL: "<|vision_start|><|image_pad|><|vision_end|>",
                Family.GEMMA3: "<start_of_image>"}[self]


def build(family: Family, path: Path) -> None:
    """A random model of ``family``, saved with its processor and tokenizer to ``path``."""
    torch.manual_seed(0)
    {Family.LLAVA: _build_llava, Family.QWEN2_5_VL: _build_qwen,
     Family.GEMMA3: _build_gemma3}[family](path)


def _tokenizer(specials: list[str]):
    from tests.conftest import build_tokenizer

    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": specials})
    return tok


def _build_llava(path: Path) -> None:
    import transformers

    tok = _tokenizer(["<image>"])
    vision = transformers.CLIPVisionConfig(**TOWER, image_size=112, patch_size=14)
    text = transformers.LlamaConfig(vocab_size=len(tok), **TEXT, bos_token_id=tok.bos_token_id,
                                    eos_token_id=tok.eos_token_id)
    config = transformers.LlavaConfig(vision_config=vision, text_config=text,
                                      image_token_id=tok.convert_tokens_to_ids("<image>"))
    transformers.LlavaForConditionalGeneration(config).save_pretrained(path)
    transformers.LlavaProcessor(
        image_processor=transformers.CLIPImageProcessorPil(
            size={"shortest_edge": 112}, crop_size={"height": 112, "width": 112}),
        tokenizer=tok, patch_size=14, vision_feature_select_strategy="default",
        num_additional_image_tokens=1).save_pretrained(path)


def _build_qwen(path: Path) -> None:
    import transformers

    tok = _tokenizer(["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"])
    ids = {n: tok.convert_tokens_to_ids(f"<|{n}|>")
           for n in ("image_pad", "video_pad", "vision_start", "vision_end")}
    vision = dict(depth=TOWER["num_hidden_layers"], hidden_size=TOWER["hidden_size"],
                  intermediate_size=TOWER["intermediate_size"],
                  num_heads=TOWER["num_attention_heads"], patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2, window_size=112, fullatt_block_indexes=[2, 5],
                  out_hidden_size=TEXT["hidden_size"], in_channels=3)
    # M-RoPE's sections over a 64-wide head: the 3B's [16, 24, 24] of 128, halved
    text = dict(vocab_size=len(tok), **TEXT, bos_token_id=tok.bos_token_id,
                eos_token_id=tok.eos_token_id,
                rope_parameters={"rope_type": "default", "mrope_section": [8, 12, 12],
                                 "rope_theta": 1_000_000.0})
    config = transformers.Qwen2_5_VLConfig(
        vision_config=vision, text_config=text, image_token_id=ids["image_pad"],
        video_token_id=ids["video_pad"], vision_start_token_id=ids["vision_start"],
        vision_end_token_id=ids["vision_end"])
    transformers.Qwen2_5_VLForConditionalGeneration(config).save_pretrained(path)
    transformers.Qwen2VLImageProcessorPil(
        min_pixels=QWEN_MIN_PIXELS, max_pixels=QWEN_MAX_PIXELS, patch_size=14,
        temporal_patch_size=2, merge_size=2).save_pretrained(path)
    tok.save_pretrained(path)


def _build_gemma3(path: Path) -> None:
    import transformers
    from tokenizers import AddedToken

    tok = _tokenizer(["<start_of_image>", "<image_soft_token>", "<end_of_image>"])
    # Gemma's vocabulary has a token per run of two to four newlines (the processor's
    # blank lines around an image)
    tok.add_tokens([AddedToken("\n" * n, normalized=False) for n in (2, 3, 4)])
    ids = {t: tok.convert_tokens_to_ids(t)
           for t in ("<start_of_image>", "<image_soft_token>", "<end_of_image>")}
    tok.init_kwargs.update(boi_token="<start_of_image>", eoi_token="<end_of_image>",
                           image_token="<image_soft_token>")
    tok.boi_token, tok.eoi_token, tok.image_token = (
        "<start_of_image>", "<end_of_image>", "<image_soft_token>")
    tok.boi_token_id = ids["<start_of_image>"]
    tok.eoi_token_id = ids["<end_of_image>"]
    tok.image_token_id = ids["<image_soft_token>"]
    vision = transformers.SiglipVisionConfig(**TOWER, image_size=GEMMA_IMAGE_SIZE,
                                             patch_size=14, vision_use_head=False)
    text = transformers.Gemma3TextConfig(
        vocab_size=len(tok), **TEXT, head_dim=64, query_pre_attn_scalar=64,
        sliding_window=512, sliding_window_pattern=6, rope_theta=1_000_000.0,
        rope_local_base_freq=10_000.0, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=0)
    config = transformers.Gemma3Config(
        vision_config=vision, text_config=text, mm_tokens_per_image=64,
        boi_token_index=ids["<start_of_image>"], eoi_token_index=ids["<end_of_image>"],
        image_token_index=ids["<image_soft_token>"])
    model = transformers.Gemma3ForConditionalGeneration(config)
    with torch.no_grad():  # transformers starts the projection at zero
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.02)
    model.save_pretrained(path)
    transformers.Gemma3Processor(
        image_processor=transformers.Gemma3ImageProcessorPil(
            size={"height": GEMMA_IMAGE_SIZE, "width": GEMMA_IMAGE_SIZE},
            image_mean=[0.5] * 3, image_std=[0.5] * 3),
        tokenizer=tok, image_seq_length=64).save_pretrained(path)


class Transformers:
    """transformers' side: the same folder's model and processor; ``first_token`` runs a
    batch of prompts (each with its one image) through ``generate`` for one token."""

    def __init__(self, family: Family, folder: str) -> None:
        import transformers

        self.family = family
        cls = {Family.LLAVA: transformers.LlavaForConditionalGeneration,
               Family.QWEN2_5_VL: transformers.Qwen2_5_VLForConditionalGeneration,
               Family.GEMMA3: transformers.Gemma3ForConditionalGeneration}[family]
        self.model = cls.from_pretrained(folder, dtype=torch.float32).eval()
        if family is Family.QWEN2_5_VL:
            # Qwen's whole processor also wants a video processor (torchvision): its two
            # halves are run here as it runs them
            self.image_processor = transformers.AutoImageProcessor.from_pretrained(folder)
            self.tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
            self.tokenizer.pad_token = "<unk>"
            self.tokenizer.padding_side = "left"  # images of other shapes: other lengths
        else:
            self.processor = transformers.AutoProcessor.from_pretrained(folder)

    def inputs(self, text: str, images: list) -> dict[str, Any]:
        if self.family is Family.LLAVA:
            return self.processor(text=[text] * len(images), images=images,
                                  return_tensors="pt")
        if self.family is Family.GEMMA3:
            return self.processor(text=[text] * len(images), images=[[im] for im in images],
                                  return_tensors="pt")
        enc = self.image_processor(images, return_tensors="pt")
        pad = "<|image_pad|>"
        before, after = text.split(pad)
        texts = [before + pad * (t * h * w // 4) + after
                 for t, h, w in enc["image_grid_thw"].tolist()]
        tokens = self.tokenizer(texts, padding=True, return_tensors="pt")
        ids = tokens["input_ids"]
        return dict(input_ids=ids, attention_mask=tokens["attention_mask"],
                    pixel_values=enc["pixel_values"], image_grid_thw=enc["image_grid_thw"],
                    mm_token_type_ids=(ids == self.model.config.image_token_id).int())

    def first_token(self, text: str, images: list) -> list[int]:
        """Each prompt's greedy first token."""
        enc = self.inputs(text, images)
        with torch.inference_mode():
            out = self.model.generate(**enc, max_new_tokens=1, do_sample=False)
        return out[:, -1].tolist()
