"""ModernBERT: a pre-norm bidirectional encoder with RoPE, GeGLU feed-forward layers, no
biases (by default), and attention that alternates between global layers and local ones,
where a token sees only the tokens within ``local_attention // 2`` positions of it.

Module names follow the Hugging Face checkpoints (``embeddings.tok_embeddings``,
``layers.N.attn.Wqkv``, ``head.dense``...), so their tensors load by name. Local and global
layers differ only in their key mask and RoPE base; both masks are built once per batch
from its (bucketed) shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from server.models.encoders.bert import ACTIVATIONS
from server.models.encoders.st_folder import PoolingType

_FULL, _SLIDING = "full_attention", "sliding_attention"
_HEAD_POOLING = {"cls": PoolingType.CLS, "mean": PoolingType.MEAN}


@dataclass(frozen=True, slots=True)
class ModernBertConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    max_position_embeddings: int
    norm_eps: float
    norm_bias: bool
    attention_bias: bool
    mlp_bias: bool
    hidden_act: str
    classifier_act: str
    classifier_bias: bool
    classifier_pooling: PoolingType
    local_layers: tuple[bool, ...]  # per layer: attends within the local window only
    half_window: int  # a local layer's token sees keys at most this many positions away
    global_theta: float
    local_theta: float
    num_labels: int

    @classmethod
    def from_hf(cls, hf: Any) -> ModernBertConfig:
        for name in ("hidden_activation", "classifier_activation"):
            act = getattr(hf, name, "gelu")
            if act not in ACTIVATIONS:
                raise ValueError(f"{name} {act!r} is not supported ({', '.join(ACTIVATIONS)})")
        pooling = getattr(hf, "classifier_pooling", "cls")
        if pooling not in _HEAD_POOLING:
            raise ValueError(f"classifier_pooling {pooling!r} is not supported (cls or mean)")
        types = getattr(hf, "layer_types", None) or [
            _SLIDING if i % getattr(hf, "global_attn_every_n_layers", 3) else _FULL
            for i in range(hf.num_hidden_layers)]
        if set(types) - {_FULL, _SLIDING}:
            raise ValueError(f"layer types {sorted(set(types))} are not supported")
        rope = getattr(hf, "rope_parameters", None) or {}
        thetas = {}
        for kind, legacy, default in ((_FULL, "global_rope_theta", 160000.0),
                                      (_SLIDING, "local_rope_theta", 10000.0)):
            params = rope.get(kind) or {}
            if params.get("rope_type", "default") != "default":
                raise ValueError(f"RoPE scaling {params['rope_type']!r} is not supported for "
                                 "ModernBERT")
            thetas[kind] = float(params.get("rope_theta") or getattr(hf, legacy, None)
                                 or default)
        if hf.hidden_size % hf.num_attention_heads:
            raise ValueError("hidden_size must be a multiple of num_attention_heads")
        return cls(hf.vocab_size, hf.hidden_size, hf.intermediate_size, hf.num_hidden_layers,
                   hf.num_attention_heads, hf.max_position_embeddings, hf.norm_eps,
                   bool(getattr(hf, "norm_bias", False)),
                   bool(getattr(hf, "attention_bias", False)),
                   bool(getattr(hf, "mlp_bias", False)),
                   getattr(hf, "hidden_activation", "gelu"),
                   getattr(hf, "classifier_activation", "gelu"),
                   bool(getattr(hf, "classifier_bias", False)), _HEAD_POOLING[pooling],
                   tuple(t == _SLIDING for t in types), int(hf.local_attention) // 2,
                   thetas[_FULL], thetas[_SLIDING], getattr(hf, "num_labels", 2))

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def max_tokens(self) -> int:
        return self.max_position_embeddings


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    xf = x.float()  # rotated in float32, as the reference does, whatever the dtype
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


class Embeddings(nn.Module):
    def __init__(self, cfg: ModernBertConfig) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps, bias=cfg.norm_bias)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.norm(self.tok_embeddings(input_ids))


class Attention(nn.Module):
    def __init__(self, cfg: ModernBertConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.head_dim
        self.Wqkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=cfg.attention_bias)
        self.Wo = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=cfg.attention_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        bs, n, hidden = x.shape
        qkv = self.Wqkv(x).view(bs, n, 3, self.num_heads, self.head_dim).transpose(1, 3)
        q, k, v = qkv.unbind(dim=2)  # each [bs, heads, n, head_dim]
        out = F.scaled_dot_product_attention(_rotate(q, cos, sin), _rotate(k, cos, sin), v,
                                             attn_mask=mask)
        return self.Wo(out.transpose(1, 2).reshape(bs, n, hidden))


class MLP(nn.Module):
    """GeGLU: ``Wo(act(a) * b)`` where ``Wi`` gives ``[a, b]``."""

    def __init__(self, cfg: ModernBertConfig) -> None:
        super().__init__()
        self.Wi = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.Wo = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.Wi(x).chunk(2, dim=-1)
        return self.Wo(self.act(a) * b)


class Layer(nn.Module):
    def __init__(self, cfg: ModernBertConfig, first: bool) -> None:
        super().__init__()
        # the first layer reads the embeddings' own norm: no attention norm of its own
        self.attn_norm: nn.Module = (nn.Identity() if first else
                                     nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps,
                                                  bias=cfg.norm_bias))
        self.attn = Attention(cfg)
        self.mlp_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps, bias=cfg.norm_bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, mask)
        return x + self.mlp(self.mlp_norm(x))


class PredictionHead(nn.Module):
    """``ModernBertForSequenceClassification``'s head before its classifier:
    norm(act(dense(pooled)))."""

    def __init__(self, cfg: ModernBertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=cfg.classifier_bias)
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps, bias=cfg.norm_bias)
        self.act = ACTIVATIONS[cfg.classifier_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.act(self.dense(x)))


class ModernBertEncoder(nn.Module):
    """Final-norm token states of a right-padded batch; with ``classify`` also the class
    logits of each row (from the pooled states its ``classifier_pooling`` names)."""

    def __init__(self, cfg: ModernBertConfig, classify: bool) -> None:
        super().__init__()
        self.cfg = cfg
        self.embeddings = Embeddings(cfg)
        self.layers = nn.ModuleList(Layer(cfg, i == 0) for i in range(cfg.num_layers))
        self.final_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps, bias=cfg.norm_bias)
        self.classify = classify
        if classify:
            self.head_block = PredictionHead(cfg)
            self.classifier = nn.Linear(cfg.hidden_size, cfg.num_labels)

    def _rope(self, n: int, theta: float, device: torch.device
              ) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.cfg.head_dim
        inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, device=device,
                                                 dtype=torch.float32) / d))
        freqs = torch.outer(torch.arange(n, device=device, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def forward(self, input_ids: torch.Tensor, token_types: torch.Tensor,
                lengths: torch.Tensor) -> torch.Tensor:
        del token_types  # ModernBERT has no segment embeddings
        n = input_ids.shape[1]
        device = input_ids.device
        pos = torch.arange(n, device=device)
        # keys past a row's length are padding; a padding row (length 0) keeps one key so
        # that softmax has something to normalize (its output is dropped)
        valid = pos[None, :] < lengths.clamp(min=1)[:, None]
        full = valid[:, None, None, :]
        near = (pos[None, :] - pos[:, None]).abs() <= self.cfg.half_window
        local = full & near[None, None]
        rope = {False: self._rope(n, self.cfg.global_theta, device),
                True: self._rope(n, self.cfg.local_theta, device)}
        x = self.embeddings(input_ids)
        for layer, is_local in zip(self.layers, self.cfg.local_layers):
            cos, sin = rope[is_local]
            x = layer(x, cos, sin, local if is_local else full)
        return self.final_norm(x)

    def head(self, pooled: torch.Tensor) -> torch.Tensor:
        """Class logits from the pooled states ``[rows, hidden]``."""
        return self.classifier(self.head_block(pooled))

    def pack_for_cpu(self) -> int:
        """Eager CPU: every linear packed in oneDNN's blocked layout (GeGLU's activation
        multiplies half the output by the other half: nothing to fuse into the GEMM)."""
        from server.hpu.cpu.linear import pack_linear_layers

        return pack_linear_layers(self)

    @staticmethod
    def checkpoint_name(name: str) -> str | None:
        """The module name of a checkpoint tensor (None: not used, e.g. the MLM decoder)."""
        name = name.removeprefix("model.")
        if name.startswith("decoder."):
            return None
        if name.startswith("head."):  # the classifier's head (an MLM one when not classifying)
            return "head_block." + name[len("head."):]
        return name
