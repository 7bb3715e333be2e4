"""PEFT LoRA checkpoints (``adapter_config.json`` + ``adapter_model.safetensors``) read and
checked against the served model, scaling folded in.

A loaded adapter is, per decoder layer and projection site of the model (the fused qkv and
gate_up linears, o and down), one ``A`` ``[P * r, in]`` and one ``B^T`` ``[r, out]`` where
``P`` is the site's parts (q/k/v: 3, gate/up: 2): part ``p`` owns ``A``'s rows
``p * r .. p * r + r`` and writes only its own output columns of ``B^T`` from them, so one
shrink serves the fused linear and each part's expand multiplies only its own columns
(see ops.py). A checkpoint of a fused base (Phi-3's ``qkv_proj``) has one ``A`` for every
column: it is repeated in each part's rows. ``B`` carries the scaling (``alpha / r``, or
``alpha / sqrt(r)`` with rsLoRA).
"""

from __future__ import annotations

import enum
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from server.models.config import ModelConfig
from server.models.rotary import interleaved_to_halves

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


class AdapterError(ValueError):
    """An adapter that cannot be served with this model; the message names the problem."""


class LoRASite(enum.Enum):
    """The model's linears that take adapters."""

    QKV = "qkv_proj"
    O = "o_proj"
    GATE_UP = "gate_up_proj"
    DOWN = "down_proj"


# PEFT module name -> (site, part); part None: the fused linear itself
TARGETS: dict[str, tuple[LoRASite, int | None]] = {
    "q_proj": (LoRASite.QKV, 0), "k_proj": (LoRASite.QKV, 1), "v_proj": (LoRASite.QKV, 2),
    "qkv_proj": (LoRASite.QKV, None), "o_proj": (LoRASite.O, 0),
    "gate_proj": (LoRASite.GATE_UP, 0), "up_proj": (LoRASite.GATE_UP, 1),
    "gate_up_proj": (LoRASite.GATE_UP, None), "down_proj": (LoRASite.DOWN, 0),
}
# (Llama 4 names its MLPs feed_forward)
_KEY = re.compile(
    r"(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp|feed_forward)\.(\w+)\.lora_(A|B)\.weight$")


@dataclass(frozen=True, slots=True)
class SiteShape:
    """A site's input width and its parts' output widths."""

    inputs: int
    parts: tuple[int, ...]

    @property
    def outputs(self) -> int:
        return sum(self.parts)


def site_shapes(cfg: ModelConfig) -> dict[LoRASite, SiteShape]:
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {
        LoRASite.QKV: SiteShape(cfg.hidden_size, (q, kv, kv)),
        LoRASite.O: SiteShape(q, (cfg.hidden_size,)),
        LoRASite.GATE_UP: SiteShape(cfg.hidden_size, (cfg.intermediate_size,) * 2),
        LoRASite.DOWN: SiteShape(cfg.intermediate_size, (cfg.hidden_size,)),
    }


def site_layers(cfg: ModelConfig, site: LoRASite) -> list[int]:
    """The layers where ``site`` is a dense linear (mixture-of-experts layers have no
    gate_up / down of their own)."""
    if site in (LoRASite.GATE_UP, LoRASite.DOWN):
        return [i for i in range(cfg.num_layers) if i not in cfg.moe_layers]
    return list(range(cfg.num_layers))


@dataclass(slots=True)
class LoRAAdapter:
    """One adapter's weights in host memory: ``(layer, site) -> (A [P * r, in], B^T [r,
    out])`` at its own rank, scaling folded into ``B^T``."""

    rank: int
    weights: dict[tuple[int, LoRASite], tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size()
                   for a, b in self.weights.values())


def load_peft_adapter(path: str | Path, cfg: ModelConfig, max_rank: int,
                      dtype: torch.dtype) -> LoRAAdapter:
    """Reads and checks a PEFT LoRA folder; raises :class:`AdapterError` naming the
    problem (missing file, rank above ``max_rank``, a target this model has not, a tensor
    whose shape is not its base layer's)."""
    folder = Path(path)
    config_file, weights_file = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    for file in (config_file, weights_file):
        if not file.is_file():
            raise AdapterError(f"LoRA adapter {folder}: no {file.name} there")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(f"LoRA adapter {folder}: {CONFIG_FILE} is not JSON ({exc})") from None
    rank, scaling = _check_config(folder, config, max_rank)
    shapes = site_shapes(cfg)
    pieces: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(weights_file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                match = _KEY.match(key)
                if match is None:
                    raise AdapterError(f"LoRA adapter {folder}: tensor {key} is no LoRA A/B "
                                       "of a decoder layer's projection")
                layer, module, which = int(match[1]), match[2], match[3]
                pieces.setdefault((layer, module), {})[which] = f.get_tensor(key)
    except AdapterError:
        raise
    except Exception as exc:  # a damaged file: safetensors' own error types vary
        raise AdapterError(f"LoRA adapter {folder}: cannot read {WEIGHTS_FILE} ({exc})") from None
    if not pieces:
        raise AdapterError(f"LoRA adapter {folder}: {WEIGHTS_FILE} holds no LoRA weights")
    weights: dict[tuple[int, LoRASite], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, module), ab in sorted(pieces.items()):
        where = f"LoRA adapter {folder}: layers.{layer}.{module}"
        if module not in TARGETS:
            raise AdapterError(f"{where}: unknown target module {module!r} (supported: "
                               f"{', '.join(TARGETS)})")
        site, part = TARGETS[module]
        if layer >= cfg.num_layers or layer not in site_layers(cfg, site):
            raise AdapterError(f"{where}: the model has no such dense layer "
                               f"({cfg.num_layers} layers)")
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{where}: lora_A and lora_B must both be present")
        a, b = ab["A"], ab["B"]
        shape = shapes[site]
        out = shape.outputs if part is None else shape.parts[part]
        r = a.shape[0]
        if r > max_rank:
            raise AdapterError(f"{where}: LoRA rank {r} is greater than max_lora_rank "
                               f"{max_rank}")
        if tuple(a.shape) != (r, shape.inputs) or tuple(b.shape) != (out, r):
            raise AdapterError(
                f"{where}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit the "
                f"base layer ({out} x {shape.inputs}, rank {r}): wrong base model?")
        if cfg.interleaved_rope and site is LoRASite.QKV:
            if part is None:
                raise AdapterError(f"{where}: a fused qkv adapter of an interleaved-RoPE "
                                   "model is not supported")
            if part < 2:  # q / k outputs, reordered as the base rows were
                b = interleaved_to_halves(b, cfg.head_dim)
        num_parts = len(shape.parts)
        a_all, bt_all = weights.get((layer, site), (None, None))
        if a_all is None or bt_all is None:
            a_all = torch.zeros(num_parts * rank, shape.inputs)
            bt_all = torch.zeros(rank, shape.outputs)
        owned = range(num_parts) if part is None else (part,)  # a fused A serves every part
        if any(a_all[p * rank:(p + 1) * rank].any() for p in owned):
            raise AdapterError(f"{where}: given twice (fused and split)")
        cols = (0 if part is None else sum(shape.parts[:part]))
        for p in owned:
            a_all[p * rank:p * rank + r] = a.float()
        bt_all[:r, cols:cols + out] = b.float().t() * scaling(r)
        weights[(layer, site)] = (a_all, bt_all)
    return LoRAAdapter(rank, {k: (a.to(dtype), bt.to(dtype)) for k, (a, bt) in weights.items()})


def _check_config(folder: Path, config: dict, max_rank: int):  # noqa: ANN202
    """(rank, scaling of a module of rank r) from ``adapter_config.json``; refuses what
    this server would otherwise ignore and answer differently for."""
    where = f"LoRA adapter {folder}: {CONFIG_FILE}"
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{where}: peft_type {config.get('peft_type')!r} is not LORA")
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"{where}: r must be a positive integer (got {rank!r})")
    if rank > max_rank:
        raise AdapterError(f"{where}: LoRA rank {rank} is greater than max_lora_rank "
                           f"{max_rank}")
    for key, off in (("use_dora", False), ("bias", "none"), ("modules_to_save", None),
                     ("rank_pattern", {}), ("alpha_pattern", {}), ("fan_in_fan_out", False)):
        value = config.get(key, off)
        if value != off and not (off in ({}, None) and not value):
            raise AdapterError(f"{where}: {key}={value!r} is not supported")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        unknown = [t for t in targets if t.rsplit(".", 1)[-1] not in TARGETS]
        if unknown:
            raise AdapterError(f"{where}: unknown target modules {unknown} (supported: "
                               f"{', '.join(TARGETS)})")
    alpha = float(config.get("lora_alpha", rank))
    rslora = bool(config.get("use_rslora", False))

    def scaling(r: int) -> float:
        del r  # PEFT scales every module by the config's r (patterns refused above)
        return alpha / math.sqrt(rank) if rslora else alpha / rank

    return rank, scaling
