"""From token states to one vector per row, inside the bucketed forward (fixed shapes), and
the per-request finishing touches after it (dimensions, normalization, activation)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from server.engine.pooling.params import PoolingParams, PoolingTask
from server.models.encoders.st_folder import PoolingType


def pool(hidden: torch.Tensor, lengths: torch.Tensor, mode: PoolingType) -> torch.Tensor:
    """``[rows, hidden]`` from ``[rows, length, hidden]`` right-padded states (padding rows
    have length 0 and give garbage that the caller drops)."""
    if mode is PoolingType.CLS:
        return hidden[:, 0]
    if mode is PoolingType.LAST:
        last = (lengths - 1).clamp(min=0)
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    mask = (torch.arange(hidden.shape[1], device=hidden.device)[None, :]
            < lengths[:, None]).to(hidden.dtype)
    summed = (hidden * mask[..., None]).sum(1, dtype=torch.float32)
    return summed / lengths.clamp(min=1)[:, None].to(torch.float32)


def finish(row: torch.Tensor, params: PoolingParams, default_normalize: bool) -> list[float]:
    """One request's result from its pooled row (float32): an embedding cut to
    ``dimensions`` and normalized, or a classifier's probabilities / score."""
    row = row.float()
    if params.task is PoolingTask.EMBED:
        if params.dimensions is not None:
            row = row[:params.dimensions]
        normalize = default_normalize if params.normalize is None else params.normalize
        if normalize:
            row = F.normalize(row, dim=-1)
    elif params.activation:
        row = torch.sigmoid(row) if row.numel() == 1 else torch.softmax(row, dim=-1)
    return row.tolist()
