"""A tiny target and draft pair for speculative decoding's draft_model tests (one
vocabulary; the draft a truncated copy of the target, so most drafts are accepted)."""

from __future__ import annotations

import copy
from pathlib import Path

import torch


def save(model, tokenizer, path: Path) -> str:
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return str(path)


def draft_pair(model, tokenizer, folder: Path, perturb: float = 0.2) -> tuple[str, str]:
    """(target, draft): the draft is the tiny model with its attention scaled up (so what
    it drafts depends on its KV cache: stale K/V change its drafts); the target is the
    draft plus one more layer, whose output is scaled by ``perturb`` (so the two mostly
    agree: drafts are accepted, and sometimes rejected)."""
    draft = copy.deepcopy(model)
    with torch.no_grad():
        for layer in draft.model.layers:
            attn = layer.self_attn
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
                proj.weight.mul_(1.7)
    target = copy.deepcopy(draft)
    extra = copy.deepcopy(target.model.layers[-1])
    extra.self_attn.layer_idx = len(target.model.layers)
    with torch.no_grad():
        extra.self_attn.o_proj.weight.mul_(perturb)
        extra.mlp.down_proj.weight.mul_(perturb)
    target.model.layers.append(extra)
    target.config.num_hidden_layers += 1
    if getattr(target.config, "layer_types", None):
        target.config.layer_types = [*target.config.layer_types, target.config.layer_types[-1]]
    return (save(target, tokenizer, folder / "target"), save(draft, tokenizer, folder / "draft"))
