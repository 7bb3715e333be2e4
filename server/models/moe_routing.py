"""How a mixture-of-experts router turns its logits into each token's top-k experts and
their weights, static shapes throughout (top-k, scatter and masks; nothing data-shaped).

Mixtral and Qwen3-MoE: softmax over all experts, top-k, renormalised where configured.
DeepSeek adds two steps (``RouterSettings``):

- V3 scores experts by a sigmoid and picks them by score plus a learned per-expert
  correction bias (``e_score_correction_bias``, a load-balancing term: it chooses, it
  does not weigh); V2 keeps the softmax.
- Grouped top-k: the experts form ``groups`` equal groups; only the ``topk_groups``
  best groups (V3: the sum of each group's two best biased scores; V2: its best score)
  are eligible, then the top k of those experts are taken.

The chosen experts' unbiased scores, renormalised where configured, are multiplied by
``routed_scaling_factor``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class Scoring(str, enum.Enum):
    SOFTMAX = "softmax"
    SIGMOID = "sigmoid"


class GroupScore(str, enum.Enum):
    """How a group of experts is ranked in grouped top-k."""

    MAX = "max"  # DeepSeek-V2's group_limited_greedy
    TOP2_SUM = "top2_sum"  # DeepSeek-V3: its two best biased scores


@dataclass(frozen=True, slots=True)
class RouterSettings:
    scoring: Scoring = Scoring.SOFTMAX
    groups: int = 1  # 1: no grouping
    topk_groups: int = 1
    group_score: GroupScore = GroupScore.MAX
    scaling: float = 1.0  # routed_scaling_factor
    score_bias: bool = False  # e_score_correction_bias picks (V3)


def route(logits: torch.Tensor, top_k: int, renormalize: bool, settings: RouterSettings,
          bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits ``[T, E]`` (float32) -> (weights ``[T, k]`` float32, expert ids ``[T, k]``)."""
    if settings.scoring is Scoring.SIGMOID:
        scores = logits.sigmoid()
    else:
        scores = torch.softmax(logits, dim=-1)
    choice = scores + bias if bias is not None else scores
    if settings.groups > 1:
        choice = _eligible_groups(choice, settings)
    if choice is scores:
        weights, ids = torch.topk(scores, top_k, dim=-1)
    else:
        ids = torch.topk(choice, top_k, dim=-1)[1]
        weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if settings.scaling != 1.0:
        weights = weights * settings.scaling
    return weights, ids


def _eligible_groups(choice: torch.Tensor, settings: RouterSettings) -> torch.Tensor:
    """``choice`` with the experts outside each token's ``topk_groups`` best groups at
    -inf."""
    tokens, experts = choice.shape
    grouped = choice.view(tokens, settings.groups, experts // settings.groups)
    if settings.group_score is GroupScore.TOP2_SUM:
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
    else:
        group_scores = grouped.amax(dim=-1)
    best = torch.topk(group_scores, settings.topk_groups, dim=-1)[1]
    keep = torch.zeros_like(group_scores).scatter_(1, best, 1.0).bool()
    return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(tokens, experts)
