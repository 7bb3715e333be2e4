"""The vision encoder's buckets: (images per call, patches per image) where every image is
one size (LLaVA), patches per call where images of any size are packed into one sequence
(Qwen2.5-VL's dynamic resolution). Pure Python, so the ``buckets`` command prints them
without loading a model."""

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


def format_encoder_plan(buckets: list[int], patches: int, pixels: str,
                        unit: str = "images") -> str:
    """``unit``: what one input is ("tiles": Llama 4's, several per image)."""
    return (f"Generated {len(buckets)} encoder buckets [{unit}, patches] ({pixels} pixels "
            f"per {unit[:-1]}): {[(n, patches) for n in buckets]}")


def max_encoder_patches(image_limit: int, max_num_seqs: int, max_num_batched_tokens: int,
                        most_tokens: int, merge_unit: int) -> int:
    """The most patches one packed encoder call needs: the images one prefill step can
    reach (its token budget of image rows, no more than every sequence's allowance of the
    largest images), ``merge_unit`` patches a row."""
    rows = min(image_limit * max_num_seqs * most_tokens, max(max_num_batched_tokens,
                                                             most_tokens))
    return max(1, rows) * merge_unit


def patch_buckets(fewest: int, most: int, multiple: int) -> list[int]:
    """Patches per packed call: doubling from the smallest image's patches (a power of
    two) up to ``most``, each a multiple of ``multiple`` (whole merged rows)."""
    def whole(n: int) -> int:
        return -(-n // multiple) * multiple

    sizes, n = [], 1
    while n < fewest:
        n *= 2
    while n < most:
        if whole(n) not in sizes:
            sizes.append(whole(n))
        n *= 2
    top = whole(most)
    return [s for s in sizes if s < top] + [top]


def format_patch_plan(buckets: list[int], fewest: int, most: int, unit: int) -> str:
    return (f"Generated {len(buckets)} encoder buckets [patches per call] (images of "
            f"{fewest} to {most} tokens of {unit} patches, packed into one call, padded to "
            f"the bucket): {buckets}")
