"""BERT and XLM-RoBERTa encoders: absolute positions, token types, post-LayerNorm, GELU,
bidirectional attention over a padded batch (no KV cache).

Module names follow the Hugging Face checkpoints (``embeddings.word_embeddings``,
``encoder.layer.N.attention.self.query``...), so their tensors load by name. XLM-RoBERTa is
BERT whose positions start after the padding id (``padding_idx + 1``), with one token type.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ACTIVATIONS = {"gelu": lambda x: F.gelu(x), "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
               "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}
# head sizes torch.ops.hpu_serve.encoder_attention is instantiated for (its dispatch_dim)
KERNEL_HEAD_SIZES = (16, 32, 64, 96, 128)
# the same activations as oneDNN's GEMM epilogues name them: (activation, algorithm)
_ONEDNN_ACTS = {"gelu": ("gelu", "none"), "gelu_new": ("gelu", "tanh"),
                "gelu_pytorch_tanh": ("gelu", "tanh"), "relu": ("relu", "")}


@dataclass(frozen=True, slots=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str
    position_offset: int  # XLM-RoBERTa: padding_idx + 1; BERT: 0
    num_labels: int

    @classmethod
    def from_hf(cls, hf: Any, roberta: bool) -> BertConfig:
        act = getattr(hf, "hidden_act", "gelu")
        if act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {act!r} is not supported ({', '.join(ACTIVATIONS)})")
        if getattr(hf, "position_embedding_type", "absolute") not in ("absolute", None):
            raise ValueError("only absolute position embeddings are supported")
        pad = getattr(hf, "pad_token_id", 0) or 0
        return cls(hf.vocab_size, hf.hidden_size, hf.num_hidden_layers,
                   hf.num_attention_heads, hf.intermediate_size, hf.max_position_embeddings,
                   getattr(hf, "type_vocab_size", 2), hf.layer_norm_eps, act,
                   pad + 1 if roberta else 0, getattr(hf, "num_labels", 2))

    @property
    def max_tokens(self) -> int:
        """The longest input the position table holds."""
        return self.max_position_embeddings - self.position_offset


class Embeddings(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.offset = cfg.position_offset

    def forward(self, input_ids: torch.Tensor, token_types: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device) + self.offset
        x = (self.word_embeddings(input_ids) + self.token_type_embeddings(token_types)
             + self.position_embeddings(positions))
        return self.LayerNorm(x)


class SelfAttention(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.query = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.key = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.value = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.qkv: nn.Module | None = None  # eager CPU: the three projections as one GEMM
        self.kernel = False  # eager CPU: the fused encoder attention reads qkv directly

    def fuse_qkv(self, kernel: bool) -> None:
        """One packed GEMM for the three projections (one pass over the input, a 3x wider
        output that oneDNN blocks better); with ``kernel``, attention reads its output in
        place (``torch.ops.hpu_serve.encoder_attention``) instead of three head views."""
        from server.hpu.cpu.linear import PackedLinear

        parts = (self.query, self.key, self.value)
        fused = nn.Linear(parts[0].in_features, 3 * parts[0].out_features,
                          dtype=parts[0].weight.dtype)
        with torch.no_grad():
            fused.weight.copy_(torch.cat([p.weight for p in parts]))
            fused.bias.copy_(torch.cat([p.bias for p in parts]))
        self.qkv = PackedLinear(fused)
        self.kernel = kernel
        del self.query, self.key, self.value

    def forward(self, x: torch.Tensor, mask: torch.Tensor, lengths: torch.Tensor
                ) -> torch.Tensor:
        bs, n, hidden = x.shape
        if self.qkv is None:
            q, k, v = self.query(x), self.key(x), self.value(x)
        else:
            qkv = self.qkv(x)
            if self.kernel:
                return torch.ops.hpu_serve.encoder_attention(
                    qkv, lengths, self.num_heads, (hidden // self.num_heads) ** -0.5)
            q, k, v = qkv.split(hidden, dim=-1)

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(bs, n, self.num_heads, -1).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), attn_mask=mask)
        return out.transpose(1, 2).reshape(bs, n, hidden)


class DenseNorm(nn.Module):
    """A projection added to the residual, then LayerNorm (BERT's post-norm)."""

    def __init__(self, cfg: BertConfig, size_in: int) -> None:
        super().__init__()
        self.dense = nn.Linear(size_in, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class Attention(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.self = SelfAttention(cfg)
        self.output = DenseNorm(cfg, cfg.hidden_size)


class Intermediate(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.dense: nn.Module = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.act_name = cfg.hidden_act
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.act_fused = False  # set when the activation runs inside a packed GEMM

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dense(x)
        return y if self.act_fused else self.act(y)


class Layer(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.attention = Attention(cfg)
        self.intermediate = Intermediate(cfg)
        self.output = DenseNorm(cfg, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, lengths: torch.Tensor
                ) -> torch.Tensor:
        x = self.attention.output(self.attention.self(x, mask, lengths), x)
        return self.output(self.intermediate(x), x)


class Encoder(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(Layer(cfg) for _ in range(cfg.num_layers))


class BertPooler(nn.Module):
    """``BertForSequenceClassification``'s pooler: tanh(dense(CLS state))."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, cls: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(cls))


class RobertaClassificationHead(nn.Module):
    """XLM-RoBERTa's classifier: out_proj(tanh(dense(CLS state)))."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.out_proj = nn.Linear(cfg.hidden_size, cfg.num_labels)

    def forward(self, cls: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.dense(cls)))


class BertEncoder(nn.Module):
    """Token states of a right-padded batch; with ``classify`` also the class logits of each
    row (from its first token, as the checkpoint's head computes them)."""

    def __init__(self, cfg: BertConfig, roberta: bool, classify: bool) -> None:
        super().__init__()
        self.cfg = cfg
        self.embeddings = Embeddings(cfg)
        self.encoder = Encoder(cfg)
        self.roberta = roberta
        self.classify = classify
        if classify and roberta:
            self.classifier: nn.Module = RobertaClassificationHead(cfg)
        elif classify:
            self.pooler = BertPooler(cfg)
            self.classifier = nn.Linear(cfg.hidden_size, cfg.num_labels)

    @property
    def layers(self) -> list[nn.Module]:
        return list(self.encoder.layer)

    def forward(self, input_ids: torch.Tensor, token_types: torch.Tensor,
                lengths: torch.Tensor) -> torch.Tensor:
        n = input_ids.shape[1]
        # keys past a row's length are padding; a padding row (length 0) keeps one key so
        # that softmax has something to normalize (its output is dropped)
        valid = torch.arange(n, device=input_ids.device)[None, :] < lengths.clamp(min=1)[:, None]
        mask = valid[:, None, None, :]
        x = self.embeddings(input_ids, token_types)
        for layer in self.encoder.layer:
            x = layer(x, mask, lengths)
        return x

    def head(self, cls: torch.Tensor) -> torch.Tensor:
        """Class logits from the first token's states ``[rows, hidden]``."""
        if self.roberta:
            return self.classifier(cls)
        return self.classifier(self.pooler(cls))

    def pack_for_cpu(self, attention_kernel: bool = False) -> int:
        """Eager CPU: every linear packed in oneDNN's blocked layout, the intermediate
        activation fused into its GEMM (measured on bge-small sizes, 128-token batches of 32:
        1.1-1.4x per GEMM in float32), the query, key and value projections one GEMM, and
        with ``attention_kernel`` (the fused CPU kernels are loaded) attention read from its
        output by ``encoder_attention``: no head transposes, no work on padding keys (1.2x
        PyTorch's flash attention on full 128-token batches of 32, 2x on mixed lengths).
        Returns how many linears were packed (0: not supported, nothing changed)."""
        from server.hpu.cpu.linear import PackedLinear, pack_linear_layers, packing_supported

        dtype = next(self.parameters()).dtype
        if not packing_supported(dtype):
            return 0
        kernel = (attention_kernel and dtype in (torch.float32, torch.bfloat16)
                  and self.cfg.hidden_size // self.cfg.num_heads in KERNEL_HEAD_SIZES)
        for layer in self.encoder.layer:
            inter = layer.intermediate
            act, algorithm = _ONEDNN_ACTS[inter.act_name]
            assert isinstance(inter.dense, nn.Linear)
            inter.dense = PackedLinear(inter.dense, act, algorithm)
            inter.act_fused = True
            layer.attention.self.fuse_qkv(kernel)
        return 2 * len(self.encoder.layer) + pack_linear_layers(self)

    @staticmethod
    def checkpoint_name(name: str) -> str | None:
        """The module name of a checkpoint tensor (None: not used, e.g. MLM heads)."""
        for prefix in ("bert.", "roberta.", "model."):
            if name.startswith(prefix):
                name = name[len(prefix):]
        if name.startswith(("cls.", "lm_head.")) or name.endswith("position_ids"):
            return None
        return name
