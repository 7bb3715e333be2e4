"""Tiny DeepSeek-V3 checkpoints with an MTP layer, stored as DeepSeek stores it: the
decoder layer after the last (``model.layers.{num_hidden_layers}.*``: a full decoder layer
plus ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``, ``shared_head.head`` and
``embed_tokens``), in a shard of its own beside the target's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), "pt") as handle:
            out |= {k: handle.get_tensor(k) for k in handle.keys()}
    return out


def damp(source: str, folder: Path) -> str:
    """A copy of the target whose layers add almost nothing to the residual stream: its
    argmax is its LM head over the final norm of the current token's embedding."""
    shutil.copytree(source, folder)
    tensors = _tensors(folder)
    for name, tensor in tensors.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensor.mul_(1e-3)
    for file in folder.glob("*.safetensors"):
        file.unlink()
    save_file(tensors, str(folder / "model.safetensors"))
    return str(folder)


def add_mtp(source: str, folder: Path, seed: int = 0, copies_embedding: bool = False,
            with_head: bool = True) -> str:
    """A copy of the target at ``source`` with a random MTP layer (the decoder block shaped
    like the target's last layer, sparse). ``copies_embedding``: eh_proj passes the normed
    embedding through, the block adds nothing and the shared head is the target's final
    norm and LM head, so the layer proposes what a damped target predicts. ``with_head``
    False: no ``embed_tokens`` / ``shared_head.head`` (the target's are used)."""
    shutil.copytree(source, folder)
    target = _tensors(folder)
    config = json.loads((folder / "config.json").read_text())
    layers = config["num_hidden_layers"]
    hidden = config["hidden_size"]
    gen = torch.Generator().manual_seed(seed)
    last = f"model.layers.{layers - 1}."
    mtp = f"model.layers.{layers}."
    tensors = {}
    for name, tensor in target.items():
        if not name.startswith(last):
            continue
        if name.endswith("e_score_correction_bias"):
            new = tensor.clone()
        elif name.endswith("norm.weight"):
            new = 1 + 0.1 * torch.randn(tensor.shape, generator=gen)
        else:
            new = torch.randn(tensor.shape, generator=gen) * float(tensor.std())
            if copies_embedding and name.endswith(("o_proj.weight", "down_proj.weight")):
                new.zero_()
        tensors[mtp + name.removeprefix(last)] = new
    eh = torch.randn(hidden, 2 * hidden, generator=gen) * hidden ** -0.5
    if copies_embedding:
        eh = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], 1)
    tensors |= {
        mtp + "enorm.weight": (torch.ones(hidden) if copies_embedding
                               else 1 + 0.1 * torch.randn(hidden, generator=gen)),
        mtp + "hnorm.weight": 1 + 0.1 * torch.randn(hidden, generator=gen),
        mtp + "eh_proj.weight": eh,
        mtp + "shared_head.norm.weight": (target["model.norm.weight"].clone()
                                          if copies_embedding
                                          else 1 + 0.1 * torch.randn(hidden, generator=gen)),
    }
    if with_head:
        tensors[mtp + "embed_tokens.weight"] = target["model.embed_tokens.weight"].clone()
        head = target["lm_head.weight"]
        tensors[mtp + "shared_head.head.weight"] = (
            head.clone() if copies_embedding
            else torch.randn(head.shape, generator=gen) * float(head.std()))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "mtp.safetensors"))
    return str(folder)
