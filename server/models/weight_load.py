"""Checkpoint tensors into the model's parameters: checkpoint names mapped onto the fused
ones (q/k/v -> qkv_proj, gate/up -> gate_up_proj, each expert's projections -> the stacked
w_gate_up / w_down of moe.py), each shape checked against the parameter, and every parameter
filled. Any mismatch is a ``ModelFileError`` naming the file and the tensor; run on meta
tensors, the same walk checks a checkpoint before the model is allocated.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from server.models.config import ModelConfig
from server.models.errors import ModelFileError
from server.models.gguf_tensors import ROPE_FREQ_FACTORS
from server.models.llama import LlamaForCausalLM
from server.models.mla import deinterleave_rope_rows

logger = logging.getLogger(__name__)

_FUSED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}
# One expert's projection in a checkpoint (Mixtral's w1/w3/w2, Qwen3-MoE's names) -> the
# stacked parameter of moe.py and the half of w_gate_up it fills (None: w_down).
_EXPERT_PARTS = {
    "w1": ("w_gate_up", 0), "gate_proj": ("w_gate_up", 0),
    "w3": ("w_gate_up", 1), "up_proj": ("w_gate_up", 1),
    "w2": ("w_down", None), "down_proj": ("w_down", None),
}
_EXPERT = re.compile(r"(.*\.mlp)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
# transformers >= 5 holds the experts stacked in memory (experts.gate_up_proj [E, 2I, H],
# experts.down_proj [E, H, I]); files it writes use the per-expert names above, but accept both.
_STACKED_EXPERTS = re.compile(r"(.*\.mlp)\.experts\.(gate_up_proj|down_proj)(?:\.weight)?$")


@dataclass(slots=True)
class TensorOrigin:
    """Where a checkpoint's tensors come from, for the one-line errors: the GGUF file (and
    each Hugging Face name's GGUF tensor), or the folder (and each tensor's shard)."""

    path: str  # the GGUF file, or the folder
    gguf: bool
    names: dict[str, str] = field(default_factory=dict)

    def tensor(self, name: str) -> str:
        """``model file F: tensor 'T'`` for the checkpoint tensor the loader calls ``name``."""
        if self.gguf:
            return f"model file {self.path}: tensor {self.names.get(name, name)!r}"
        return f"model file {self.names.get(name, self.path)}: tensor {name!r}"

    @property
    def config(self) -> tuple[str, str]:
        """(the file holding the layer count, its key)."""
        if self.gguf:
            return self.path, "block_count"
        return os.path.join(self.path, "config.json"), "num_hidden_layers"


def load_into(model: LlamaForCausalLM, tensors: Iterator[tuple[str, torch.Tensor]],
              origin: TensorOrigin, dry_run: bool = False) -> None:
    """Copies the checkpoint into the model's parameters (``dry_run``: checks names and
    shapes only); a tensor with no place, of the wrong shape, or a weight missing raises
    ``ModelFileError``."""
    params = dict(model.named_parameters(remove_duplicate=False))
    cfg = model.config
    # a gated attention's q_proj holds each head's gate too (Qwen3-Next)
    q_rows = cfg.num_heads * cfg.head_dim * (2 if cfg.attn_output_gate else 1)
    shard_sizes = {
        "qkv_proj": [q_rows] + [cfg.num_kv_heads * cfg.head_dim] * 2,
        "gate_up_proj": [cfg.intermediate_size] * 2,
    }
    loaded: set[str] = set()
    mtp_skipped = 0
    for hf_name, tensor in model.checkpoint_tensors(tensors):
        # Mixtral's sparse block is "block_sparse_moe" where the others say "mlp"
        name = hf_name.removeprefix("model.").replace(".block_sparse_moe.", ".mlp.")
        if _is_mtp(name, cfg):
            mtp_skipped += 1
            continue
        if cfg.mla is not None:
            # DeepSeek: the router's bias lives on the block (the router may be repacked)
            name = name.replace(".mlp.gate.e_score_correction_bias",
                                ".mlp.e_score_correction_bias")
            if cfg.mla.rope_interleaved:
                tensor = deinterleave_rope_rows(name, tensor, cfg.mla)
        if cfg.norm_offset and name.endswith("norm.weight"):
            # Gemma keeps its norms as w - 1: w in the model dtype, as the reference holds
            # it, then 1 + w in float32 (keep_norms_in_float)
            tensor = tensor.to(model.embed_tokens.weight.dtype).float() + cfg.norm_offset
        if "rotary_emb" in name:
            continue
        if name == ROPE_FREQ_FACTORS:
            if not dry_run:
                model.rotary.apply_freq_factors(tensor.flatten())
            continue
        expert = _EXPERT.match(name)
        stacked = _STACKED_EXPERTS.match(name)
        if expert or stacked:
            target, tensor = _expert_target(params, expert, stacked, cfg, hf_name, tensor,
                                            loaded, origin)
        elif (match := re.match(r"(.*)\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$",
                                name)) and _fused_name(match) in params:
            prefix, part, kind = match.groups()
            fused, shard = _FUSED[part]
            name = f"{prefix}.{fused}.{kind}"
            param = _param(params, name, hf_name, origin)
            # gate / up: halves of whichever MLP this is (a shared expert's can be narrower)
            sizes = shard_sizes[fused] if fused == "qkv_proj" else [param.shape[0] // 2] * 2
            target = param.data.narrow(0, sum(sizes[:shard]), sizes[shard])
            loaded.add(f"{name}#{shard}")
        else:
            target = _param(params, name, hf_name, origin).data
            fused = name.split(".")[-2]
            if fused in shard_sizes:  # already fused in the checkpoint (Phi-3)
                loaded.update(f"{name}#{i}" for i in range(len(shard_sizes[fused])))
            else:
                loaded.add(name)
        if tuple(target.shape) != tuple(tensor.shape):
            raise ModelFileError(f"{origin.tensor(hf_name)} has shape {list(tensor.shape)}, "
                                 f"the config calls for {list(target.shape)}")
        if not dry_run:
            target.copy_(tensor)
    if mtp_skipped:
        logger.info("Skipped the %d tensors of the %d multi-token-prediction layer(s) "
                    "(layers %d-%d; --speculative-config mtp reads them as its draft)",
                    mtp_skipped, cfg.mtp_layers, cfg.num_layers,
                    cfg.num_layers + cfg.mtp_layers - 1)
    _check_complete(params, loaded, shard_sizes, cfg, origin)


def _fused_name(match: re.Match[str]) -> str:
    """The fused parameter a separate q/k/v or gate/up tensor would go into."""
    prefix, part, kind = match.groups()
    return f"{prefix}.{_FUSED[part][0]}.{kind}"


def _is_mtp(name: str, cfg: ModelConfig) -> bool:
    """A tensor of a multi-token-prediction layer (DeepSeek-V3 stores them as the layers
    after the decoder's)."""
    layer = re.match(r"layers\.(\d+)\.", name)
    return (cfg.mtp_layers > 0 and layer is not None
            and cfg.num_layers <= int(layer.group(1)) < cfg.num_layers + cfg.mtp_layers)


def _param(params: dict[str, torch.nn.Parameter], name: str, hf_name: str, origin: TensorOrigin
           ) -> torch.nn.Parameter:
    if name not in params:
        layers = len(_layer_numbers(params))
        layer = re.match(r"(?:model\.)?layers\.(\d+)\.", hf_name)
        beyond = (f" (the config has {layers} layers)"
                  if layer is not None and int(layer.group(1)) >= layers else "")
        raise ModelFileError(f"{origin.tensor(hf_name)} has no place in the model{beyond}")
    return params[name]


def _layer_numbers(names: Iterable[str]) -> set[int]:
    return {int(m.group(1)) for n in names if (m := re.match(r"layers\.(\d+)\.", n))}


def _expert_target(
    params: dict[str, torch.nn.Parameter], expert: re.Match[str] | None,
    stacked: re.Match[str] | None, cfg: ModelConfig, hf_name: str, tensor: torch.Tensor,
    loaded: set[str], origin: TensorOrigin,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(where in a stacked expert parameter a checkpoint tensor goes, the tensor as it goes
    there); marks the pieces it fills. Down projections are stored transposed (moe.py)."""
    inter = cfg.moe_intermediate_size
    if expert is not None:
        prefix, index, part = expert.groups()
        e = int(index)
        stack, half = _EXPERT_PARTS[part]
        param = _param(params, f"{prefix}.{stack}", hf_name, origin)
        if e >= param.shape[0]:
            raise ModelFileError(f"{origin.tensor(hf_name)}: expert {e}, the config has "
                                 f"{param.shape[0]}")
        if half is None:
            loaded.add(f"{prefix}.{stack}#{e}")
            return param.data[e], tensor.t()
        loaded.add(f"{prefix}.{stack}#{e}.{half}")
        return param.data[e].narrow(0, half * inter, inter), tensor
    assert stacked is not None
    prefix, part = stacked.groups()
    stack = "w_gate_up" if part == "gate_up_proj" else "w_down"
    name = f"{prefix}.{stack}"
    param = _param(params, name, hf_name, origin)
    loaded.update(_expert_pieces(name, param.shape[0]))
    return param.data, (tensor if stack == "w_gate_up" else tensor.transpose(1, 2))


def _expert_pieces(name: str, num_experts: int) -> list[str]:
    """What a stacked expert parameter needs from a checkpoint: both halves of every
    expert's gate/up, every expert's down."""
    if name.endswith(".w_gate_up"):
        return [f"{name}#{e}.{half}" for e in range(num_experts) for half in (0, 1)]
    return [f"{name}#{e}" for e in range(num_experts)]


def _check_complete(
    params: dict[str, torch.nn.Parameter], loaded: set[str], shard_sizes: dict[str, list[int]],
    cfg: ModelConfig, origin: TensorOrigin,
) -> None:
    missing = []
    for name in params:
        fused = name.split(".")[-2]
        if name.endswith((".w_gate_up", ".w_down")):
            missing += [p for p in _expert_pieces(name, cfg.num_experts) if p not in loaded]
        elif fused in shard_sizes:
            missing += [f"{name}#{i}" for i in range(len(shard_sizes[fused]))
                        if f"{name}#{i}" not in loaded]
        elif name not in loaded and not (name == "lm_head.weight" and "embed_tokens.weight" in loaded):
            missing.append(name)
    if not missing:
        return
    names = [_checkpoint_name(m, origin) for m in missing]
    first = re.match(r"layers\.(\d+)\.", missing[0])
    held = _layer_numbers(n.split("#")[0] for n in loaded)
    if first is not None and int(first.group(1)) not in held:
        file, key = origin.config
        holds = f"layers 0-{max(held)} only" if held else "no layer"
        raise ModelFileError(f"model file {file}: {key} says {cfg.num_layers} layers, the "
                             f"weights hold {holds}: first missing {names[0]}")
    more = f" and {len(names) - 1} more" if len(names) > 1 else ""
    raise ModelFileError(f"model file {origin.path}: the checkpoint lacks weights for "
                         f"{names[0]}{more} ({', '.join(names[:8])})")


# our fused parameters' shards -> the checkpoint's separate tensors
_UNFUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _checkpoint_name(missing: str, origin: TensorOrigin) -> str:
    """A missing piece (``layers.2.self_attn.qkv_proj.weight#1``) under the name a
    checkpoint gives it (``model.layers.2.self_attn.k_proj.weight``); experts' pieces
    (``w_gate_up#5.1``: expert 5's up half) as they are."""
    name, _, shard = missing.partition("#")
    prefix, module, kind = name.rsplit(".", 2) if name.count(".") >= 2 else ("", name, "")
    if module in _UNFUSED and shard.isdigit():
        name = f"{prefix}.{_UNFUSED[module][int(shard)]}.{kind}"
    elif shard:
        return missing
    return name if origin.gguf or not name.startswith("layers.") else f"model.{name}"
