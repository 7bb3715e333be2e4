"""The vision encoder's buckets: (images per call, patches per image). Pure Python, so the
``buckets`` command prints them without loading a model."""

from __future__ import annotations


def max_encoder_images(image_limit: int, max_num_seqs: int, max_num_batched_tokens: int,
                       tokens_per_image: int) -> int:
    """The most images one prefill step can reach: the step's token budget over one image's
    tokens, and no more than every sequence's allowance (``--limit-mm-per-prompt``)."""
    return max(1, min(image_limit * max_num_seqs, max_num_batched_tokens // tokens_per_image))


def encoder_buckets(max_images: int) -> list[int]:
    """Images per encoder call: powers of two below ``max_images``, then ``max_images``."""
    sizes, n = [], 1
    while n < max_images:
        sizes.append(n)
        n *= 2
    return sizes + [max(1, max_images)]


def format_encoder_plan(buckets: list[int], patches: int, pixels: str) -> str:
    return (f"Generated {len(buckets)} encoder buckets [images, patches] ({pixels} pixels "
            f"per image): {[(n, patches) for n in buckets]}")
