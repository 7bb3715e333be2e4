"""M-RoPE positions (Qwen2.5-VL): a token's (temporal, height, width) positions. Text tokens
count on as usual, all three equal; an image's tokens take the position where the image
starts plus their frame, row and column in its grid; the text after an image continues from
the image's start plus its larger side, so a sequence's positions run behind its token
indices by the same ``delta`` from its last image on (decodes: index + delta)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from server.engine.multimodal.inputs import ImageSpan


def mrope_delta(spans: Sequence[ImageSpan]) -> int:
    """Position minus token index after the last image (<= 0)."""
    total = 0
    for span in spans:
        assert span.grid is not None, "M-RoPE needs each image's token grid"
        _, h, w = span.grid
        total += max(h, w) - span.length
    return total


def mrope_positions(spans: Sequence[ImageSpan], index: torch.Tensor) -> torch.Tensor:
    """Positions ``[3, n]`` of the tokens at indices ``index`` (``[n]``, long) of a
    sequence whose prompt holds ``spans`` (in prompt order)."""
    out = index.unsqueeze(0).repeat(3, 1)
    shift = 0  # position minus index of the text before the current span
    for span in spans:
        assert span.grid is not None, "M-RoPE needs each image's token grid"
        _, h, w = span.grid
        local = index - span.offset
        start = span.offset + shift
        inside = (local >= 0) & (index < span.end)
        grid_pos = torch.stack([start + local // (h * w), start + (local // w) % h,
                                start + local % w])
        out = torch.where(inside, grid_pos, out)
        step = max(h, w) - span.length
        out = torch.where(index >= span.end, out + step, out)
        shift += step
    return out
