"""EAGLE heads (speculative decoding's ``eagle`` / ``eagle3``), in the checkpoint layouts
vLLM loads.

A head drafts from the target's hidden states: the hidden input at position ``p`` is the
target's *feature* at ``p - 1`` (or, past the first draft step, the head's own output at
``p - 1``), beside the embedding of the token at ``p``; the head predicts the token at
``p + 1``. (vLLM feeds position ``p - 1`` with the token at ``p``: the same pairs, every
position one lower, which RoPE cannot tell apart.)

- EAGLE-1 (``EagleLlamaForCausalLM``): ``fc`` (2H -> H) over ``[embed; feature]``, one
  decoder layer with no input norm, its output (attention + MLP + residual, no final norm)
  read by the target's ``lm_head``. The feature is the target's final, normed hidden state.
- EAGLE-3 (``LlamaForCausalLMEagle3``): the feature is ``fc`` (3H -> H) over the residual
  stream entering three of the target's layers (``eagle_aux_hidden_state_layer_ids``, else
  vLLM's ``(2, L // 2, L - 3)``); a ``midlayer`` whose attention reads ``[input_layernorm
  (embed); hidden_norm(feature)]`` (2H), its own ``norm`` and ``lm_head`` over a draft
  vocabulary that ``d2t`` maps to the target's (``target = draft + d2t[draft]``).

The embeddings are the target's unless the checkpoint has its own (EAGLE-3); EAGLE-1's
``lm_head`` too.
"""

from __future__ import annotations

import enum
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from server.hpu.attention import AttentionMetadata
from server.hpu.kv_cache import KVCache
from server.hpu.layer_ops import TorchLayerOps
from server.models.config import ModelConfig
from server.models.llama import MLP, Attention, LlamaForCausalLM
from server.models.norm import RMSNorm
from server.models.rotary import RotaryEmbedding
from server.models.safetensors_files import safetensors_files, safetensors_tensors

logger = logging.getLogger(__name__)


class HeadFormat(enum.Enum):
    EAGLE = "eagle"
    EAGLE3 = "eagle3"


class EagleLayer(nn.Module):
    """The head's one decoder layer: EAGLE-1's (no input norm) or EAGLE-3's midlayer
    (attention over the normed embedding and the normed hidden state, side by side)."""

    def __init__(self, cfg: ModelConfig, fmt: HeadFormat, norm_before_residual: bool) -> None:
        super().__init__()
        self.fmt = fmt
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.norm_before_residual = norm_before_residual
        if fmt is HeadFormat.EAGLE3:
            attn = self.self_attn
            attn.qkv_proj = nn.Linear(2 * cfg.hidden_size, attn.q_size + 2 * attn.kv_size,
                                      cfg.qkv_bias)
            self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, fc: nn.Linear,
                rope: Any, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        """``[bs, q, H]`` embeddings and hidden inputs -> the layer's output plus its
        residual stream (what the next draft step reads as its hidden input)."""
        if self.fmt is HeadFormat.EAGLE:
            x = fc(torch.cat([embeds, hidden], dim=-1))
            residual = x
        else:
            normed = self.hidden_norm(hidden)
            residual = normed if self.norm_before_residual else hidden
            x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        x = self.self_attn(x, rope, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x) + residual


class EagleHead(nn.Module):
    """An EAGLE / EAGLE-3 head beside its target (whose embeddings and, for EAGLE-1, LM
    head it shares unless the checkpoint brings its own)."""

    def __init__(self, cfg: ModelConfig, fmt: HeadFormat, target: LlamaForCausalLM,
                 aux_layers: tuple[int, ...], draft_vocab_size: int, fc_bias: bool,
                 norm_before_residual: bool, own_embeddings: bool, own_lm_head: bool,
                 max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        self.fmt = fmt
        self.aux_layers = aux_layers
        hidden = cfg.hidden_size
        target_hidden = target.config.hidden_size
        self.own_embeddings = own_embeddings
        self.own_lm_head = own_lm_head
        self.embed_tokens = (nn.Embedding(cfg.vocab_size, hidden) if own_embeddings
                             else target.embed_tokens)
        fc_in = 2 * hidden if fmt is HeadFormat.EAGLE else 3 * target_hidden
        self.fc = nn.Linear(fc_in, hidden, bias=fc_bias)
        self.layers = nn.ModuleList([EagleLayer(cfg, fmt, norm_before_residual)])
        self.norm = RMSNorm(hidden, cfg.rms_norm_eps) if fmt is HeadFormat.EAGLE3 else None
        self.lm_head = (nn.Linear(hidden, draft_vocab_size, bias=False) if own_lm_head
                        else target.lm_head)
        # EAGLE-3's draft vocabulary -> the target's ids (None: the same vocabulary)
        self.d2t: torch.Tensor | None
        if draft_vocab_size != cfg.vocab_size:
            self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))
        else:
            self.d2t = None
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta,
                                      cfg.rope_scaling)

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    def features(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """The target's forward output ``[T, H (+ 3H aux)]`` -> what the head reads per
        position ``[T, H]``: the final hidden state (EAGLE-1), ``fc`` over the three
        layers' streams (EAGLE-3)."""
        if self.fmt is HeadFormat.EAGLE:
            return target_hidden[:, :self.hidden_size]
        return self.fc(target_hidden[:, -self.fc.in_features:])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                kv_caches: list[KVCache], meta: AttentionMetadata) -> torch.Tensor:
        """input_ids/positions ``[bs, q]``, ``hidden`` ``[bs * q, H]`` -> the head's output
        ``[bs * q, H]`` (before the final norm: the next step's hidden input)."""
        embeds = self.embed_tokens(input_ids)
        rope = self.rotary(positions.reshape(-1), embeds.dtype)
        out = self.layers[0](embeds, hidden.view(embeds.shape).to(embeds.dtype), self.fc, rope,
                             kv_caches[0], meta)
        return out.reshape(-1, out.shape[-1])

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Rows of the head's output -> float32 logits over the draft vocabulary."""
        if self.norm is not None:
            hidden = self.norm(hidden)
        return self.lm_head(hidden).float()

    def share_with(self, target: LlamaForCausalLM) -> None:
        """Reads the target's embeddings (and LM head) as they are now: the platform may
        have replaced its modules since the head was loaded (packed linears)."""
        if not self.own_embeddings:
            self.embed_tokens = target.embed_tokens
        if not self.own_lm_head:
            self.lm_head = target.lm_head

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.d2t is None else draft_ids + self.d2t[draft_ids]

    def use_ops(self, ops: TorchLayerOps) -> None:
        for module in self.layers.modules():
            if hasattr(module, "ops"):
                module.ops = ops
        if self.norm is not None:
            self.norm.ops = ops


def head_format(config: dict[str, Any], method: str) -> HeadFormat:
    archs = " ".join(config.get("architectures") or [])
    fmt = HeadFormat(method)
    if "Eagle3" in archs and fmt is HeadFormat.EAGLE:
        raise ValueError("--speculative-config: the head's config.json names an EAGLE-3 "
                         "architecture: use \"method\": \"eagle3\"")
    return fmt


def head_model_config(config: dict[str, Any]) -> ModelConfig:
    """The head's config.json (a Llama config of one layer) -> the decoder's settings."""
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    rope = config.get("rope_parameters") or {}
    theta = float(config.get("rope_theta") or rope.get("rope_theta") or 10000.0)
    scaling = config.get("rope_scaling") or (rope if rope.get("rope_type", "default")
                                             != "default" else None)
    bias = bool(config.get("attention_bias", False))
    return ModelConfig(
        model_type="llama", vocab_size=int(config["vocab_size"]), hidden_size=hidden,
        intermediate_size=int(config["intermediate_size"]), num_layers=1,
        num_heads=heads, num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or hidden // heads),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)), rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
        tie_word_embeddings=False, qkv_bias=bias, o_bias=bias,
        mlp_bias=bool(config.get("mlp_bias", False)))


def load_eagle_head(folder: str, method: str, target: LlamaForCausalLM, dtype: torch.dtype,
                    device: torch.device, max_model_len: int) -> EagleHead:
    """The head in ``folder`` (config.json and safetensors or pytorch_model.bin, named as
    vLLM reads them), checked against the target; a ValueError names what does not fit."""
    where = f"--speculative-config {method}"
    path = Path(folder)
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{where}: cannot read {path / 'config.json'}: {exc}") from None
    fmt = head_format(config, method)
    cfg = head_model_config(config)
    tcfg = target.config
    if config.get("add_para_norm"):
        raise ValueError(f"{where}: HASS heads (add_para_norm) are not supported")
    if int(config.get("num_hidden_layers", 1)) != 1:
        raise ValueError(f"{where}: heads of one decoder layer only (the config has "
                         f"{config.get('num_hidden_layers')})")
    if cfg.vocab_size != tcfg.vocab_size:
        raise ValueError(f"{where}: the head's vocabulary ({cfg.vocab_size}) is not the "
                         f"target's ({tcfg.vocab_size})")
    if fmt is HeadFormat.EAGLE and cfg.hidden_size != tcfg.hidden_size:
        raise ValueError(f"{where}: the head's hidden size ({cfg.hidden_size}) is not the "
                         f"target's ({tcfg.hidden_size})")
    target_hidden = int(config.get("target_hidden_size") or cfg.hidden_size)
    if target_hidden != tcfg.hidden_size:
        raise ValueError(f"{where}: the head reads hidden states of size {target_hidden}, "
                         f"the target's are {tcfg.hidden_size}")
    tensors = dict(_canonical(_read(path)))
    eagle_config = config.get("eagle_config") or {}
    aux: tuple[int, ...] = ()
    if fmt is HeadFormat.EAGLE3:
        num = tcfg.num_layers
        aux = tuple(eagle_config.get("eagle_aux_hidden_state_layer_ids")
                    or (2, num // 2, num - 3))
        if len(aux) != 3 or not all(0 <= i < num for i in aux):
            raise ValueError(f"{where}: aux hidden-state layers {aux} do not fit the "
                             f"target's {num} layers")
    draft_vocab = int(config.get("draft_vocab_size") or cfg.vocab_size)
    own_lm_head = fmt is HeadFormat.EAGLE3 or "lm_head.weight" in tensors
    with torch.device("meta"):
        head = EagleHead(cfg, fmt, target, aux, draft_vocab, "fc.bias" in tensors,
                         bool(config.get("norm_before_residual", False)),
                         "embed_tokens.weight" in tensors and fmt is HeadFormat.EAGLE3,
                         own_lm_head, max(cfg.max_position_embeddings, max_model_len))
    shared = {id(p) for p in target.parameters()}
    for name, module in head.named_modules():  # materialize the head's own tensors only
        for pname, param in list(module.named_parameters(recurse=False)):
            if id(param) not in shared:
                setattr(module, pname, nn.Parameter(torch.empty_like(param, device=device,
                                                                     dtype=dtype),
                                                    requires_grad=False))
        for bname, buf in list(module.named_buffers(recurse=False)):
            module._buffers[bname] = torch.empty_like(buf, device=device)
        del name
    head.rotary = RotaryEmbedding(cfg.head_dim, max(cfg.max_position_embeddings,
                                                    max_model_len),
                                  cfg.rope_theta, cfg.rope_scaling).to(device)
    _fill(head, tensors, where, shared)
    head.eval()
    return head


def _read(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    if safetensors_files(path):
        yield from safetensors_tensors(path)
        return
    bins = sorted(path.glob("pytorch_model*.bin"))
    if not bins:
        raise ValueError(f"--speculative-config: no safetensors or pytorch_model.bin in {path}")
    for file in bins:
        yield from torch.load(file, map_location="cpu", weights_only=True).items()


def _canonical(tensors: Iterator[tuple[str, torch.Tensor]]
               ) -> Iterator[tuple[str, torch.Tensor]]:
    """vLLM's names of both layouts -> this module's (``midlayer.`` is ``layers.0.``; the
    speculators library's ``fusion_fc`` is ``fc``); ``t2d`` is not needed."""
    for name, tensor in tensors:
        name = name.removeprefix("model.")
        name = name.replace("midlayer.", "layers.0.").replace("fusion_fc.", "fc.")
        if name == "t2d" or name.endswith("rotary_emb.inv_freq"):
            continue
        yield name, tensor


def _fill(head: EagleHead, tensors: dict[str, torch.Tensor], where: str,
          shared: set[int]) -> None:
    """Copies the checkpoint into the head, q/k/v and gate/up fused; every tensor of the
    head's own must be there."""
    prefix = "layers.0."
    fused = {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"),
             "mlp.gate_up_proj": ("gate_proj", "up_proj")}
    for dst, parts in fused.items():
        sub = dst.split(".")[0]
        for kind in ("weight", "bias"):
            names = [f"{prefix}{sub}.{p}.{kind}" for p in parts]
            if all(n in tensors for n in names):
                tensors[f"{prefix}{dst}.{kind}"] = torch.cat([tensors.pop(n) for n in names])
    if head.fmt is HeadFormat.EAGLE:
        tensors.pop(f"{prefix}input_layernorm.weight", None)  # EAGLE-1 skips that norm
        tensors.pop("embed_tokens.weight", None)  # always the target's (as vLLM does)
    params = dict(head.named_parameters(remove_duplicate=False))
    buffers = dict(head.named_buffers())
    missing = [n for n, p in params.items() if id(p) not in shared and n not in tensors]
    if head.d2t is not None and "d2t" not in tensors:
        missing.append("d2t")
    if missing:
        raise ValueError(f"{where}: the head's checkpoint lacks {', '.join(sorted(missing))}")
    for name, tensor in tensors.items():
        target = params.get(name)
        if target is None:
            target = buffers.get(name)
        if target is None:
            logger.info("EAGLE head: ignoring the checkpoint's %s", name)
            continue
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(f"{where}: the head's {name} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(target.shape)}")
        with torch.no_grad():
            target.copy_(tensor)
