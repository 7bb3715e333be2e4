"""A tiny random Gemma 3 vision-language model built here: a SigLIP tower, Gemma 3's
projector (average pool to ``MM_TOKENS`` rows, soft-embedding norm, projection) and a Gemma 3
text model with sliding-window layers whose window is shorter than one image; saved with
its processor (Gemma 3's Pillow image processor, a tokenizer with Gemma's image tokens and
single tokens for runs of newlines, a chat template shaped like Gemma's)."""

from __future__ import annotations

from pathlib import Path

import torch

# Gemma's own template, reduced: the BOS, turns, "<start_of_image>" per image part
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>"
    "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] | trim }}{% else %}"
    "{% for p in m['content'] %}{% if p['type'] == 'image' %}<start_of_image>"
    "{% else %}{{ p['text'] | trim }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n"
    "{% endif %}"
)
IMAGE_SIZE = 32  # every image is resized (not cropped) to 32 x 32 pixels
PATCH = 4  # 8 x 8 patches, pooled 2 x 2 ...
MM_TOKENS = 16  # ... into 16 image tokens
WINDOW = 12  # the sliding layers' window: shorter than one image with its markers


def save_tiny_gemma3(path: Path, seed: int = 0):
    """(HF Gemma3ForConditionalGeneration, Gemma3Processor) of a random model saved to
    ``path``."""
    import transformers
    from tokenizers import AddedToken

    from tests.conftest import build_tokenizer

    tok = build_tokenizer()
    # Gemma's vocabulary has one token per run of two to four newlines; the processor's
    # "\n\n" around each image merges with a template's "\n" into one of them
    tok.add_tokens([AddedToken("\n" * n, normalized=False) for n in (2, 3, 4)])
    tok.add_special_tokens({"additional_special_tokens": [
        "<start_of_image>", "<image_soft_token>", "<end_of_image>", "<start_of_turn>",
        "<end_of_turn>"]})
    tok.chat_template = GEMMA3_TEMPLATE
    ids = {t: tok.convert_tokens_to_ids(t)
           for t in ("<start_of_image>", "<image_soft_token>", "<end_of_image>")}
    tok.init_kwargs.update(boi_token="<start_of_image>", eoi_token="<end_of_image>",
                           image_token="<image_soft_token>")
    tok.boi_token, tok.eoi_token, tok.image_token = (
        "<start_of_image>", "<end_of_image>", "<image_soft_token>")
    tok.boi_token_id = ids["<start_of_image>"]
    tok.eoi_token_id = ids["<end_of_image>"]
    tok.image_token_id = ids["<image_soft_token>"]
    vision = transformers.SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        image_size=IMAGE_SIZE, patch_size=PATCH, vision_use_head=False)
    text = transformers.Gemma3TextConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24,
        sliding_window=WINDOW, sliding_window_pattern=2, max_position_embeddings=512,
        rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=0)
    config = transformers.Gemma3Config(
        vision_config=vision, text_config=text, mm_tokens_per_image=MM_TOKENS,
        boi_token_index=ids["<start_of_image>"], eoi_token_index=ids["<end_of_image>"],
        image_token_index=ids["<image_soft_token>"])
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # weights that make greedy answers varied, move with the image
        for name, p in model.named_parameters():  # and with the image's bidirectional mask
            if "norm" in name:
                p.normal_(0.0, 0.5)  # Gemma's (1 + w) norms start at w = 0
            elif "embed_tokens" in name:
                p.mul_(0.5)  # scaled by sqrt(hidden) on the way in, and tied to the head
            elif p.dim() >= 2:
                p.mul_(2.0)
        # transformers starts the projection at zero: no image would change anything
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.2)
    image_processor = transformers.Gemma3ImageProcessorPil(
        size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, image_mean=[0.5] * 3,
        image_std=[0.5] * 3)
    processor = transformers.Gemma3Processor(
        image_processor=image_processor, tokenizer=tok, image_seq_length=MM_TOKENS,
        chat_template=GEMMA3_TEMPLATE)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return model, processor


def gemma3_prompt(body: str) -> str:
    """One user turn as the template writes it (``<start_of_image>`` where images go)."""
    return f"<s><start_of_turn>user\n{body}<end_of_turn>\n<start_of_turn>model\n"


def causal_reference_ids(model, processor, text: str, images: list,
                         max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation with a plain causal mask (no token_type_ids):
    what an engine that ignored Gemma 3's bidirectional image attention would answer."""
    enc = processor(text=text, images=images, return_tensors="pt")
    enc.pop("token_type_ids")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                             min_new_tokens=max_new_tokens)
    return out[0, enc["input_ids"].shape[1]:].tolist()
