"""Megatron-style tensor parallelism for the Llama-family decoder of llama.py.

Each rank holds a slice of every large weight and the model code runs unchanged on the
slices; three places talk to the other ranks:

- attention: q/k/v are column-parallel (each rank has whole heads: ``H / N`` query heads
  and ``Hkv / N`` KV heads, or one KV head replicated on ``N / Hkv`` ranks when ``N``
  exceeds ``Hkv``), ``o_proj`` is row-parallel (its input columns are the rank's heads),
  so the attention output is a partial sum: one all-reduce;
- the MLP: gate/up column-parallel, down row-parallel (one all-reduce); in a sparse layer
  every expert's intermediate dimension is split the same way (the router is replicated
  and routes identically on every rank), again one all-reduce of the block's output;
- multi-head latent attention (DeepSeek): the query projection, ``kv_b_proj`` (latent to
  each head's key and value) and ``o_proj`` are split by heads as above; the latent's own
  projection and norm are replicated, so every rank caches the whole latent (it is one
  "head" shared by all) and attends over it with its own heads;
- the vocabulary: the embedding and the LM head are split by vocabulary rows (padded to
  a multiple of ``N``); a token's embedding comes from the one rank that owns it (an
  all-reduce of mostly zeros) and the logits of every rank are gathered, then trimmed.

A row-parallel layer's bias must be added once: rank 0 loads it, the others load zeros.
:class:`ShardPlan` turns each checkpoint tensor into the rank's slice as it is read, so no
rank ever holds the full model.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from server.hpu.distributed import ParallelContext
from server.models.config import ModelConfig
from server.models.llama import LlamaForCausalLM
from server.models.lora import LoRAAdapter, LoRASite
from server.models.model_class import causal_lm_class
from server.models.qwen3_next import Qwen3NextForCausalLM


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class ShardPlan:
    """Which slice of every weight rank ``rank`` of ``world_size`` holds."""

    config: ModelConfig  # the whole model's
    rank: int
    world_size: int

    @classmethod
    def build(cls, cfg: ModelConfig, rank: int, world_size: int) -> ShardPlan:
        """Checks that the model splits evenly into ``world_size`` ranks."""
        n = world_size
        problems = []
        if cfg.num_heads % n:
            problems.append(f"{cfg.num_heads} attention heads")
        if cfg.num_kv_heads % n and n % cfg.num_kv_heads:
            problems.append(f"{cfg.num_kv_heads} KV heads (neither divides the other)")
        if cfg.intermediate_size % n:
            problems.append(f"intermediate size {cfg.intermediate_size}")
        if cfg.num_experts and cfg.moe_intermediate_size % n:
            problems.append(f"expert intermediate size {cfg.moe_intermediate_size}")
        linear = cfg.linear_attention
        if linear is not None and (linear.num_key_heads % n or linear.num_value_heads % n):
            problems.append(f"{linear.num_key_heads} / {linear.num_value_heads} linear-"
                            "attention key / value heads")
        if cfg.shared_expert_intermediate_size % n:
            problems.append(f"shared expert size {cfg.shared_expert_intermediate_size}")
        if problems:
            raise ValueError(f"--tensor-parallel-size {n} does not divide the model: "
                             + ", ".join(problems))
        return cls(cfg, rank, world_size)

    @property
    def q_heads(self) -> int:
        return self.config.num_heads // self.world_size

    @property
    def kv_heads(self) -> int:
        """KV heads on this rank: a share, or one (replicated) when ranks outnumber them."""
        return max(1, self.config.num_kv_heads // self.world_size)

    @property
    def kv_replicas(self) -> int:
        """How many ranks hold each KV head."""
        return max(1, self.world_size // self.config.num_kv_heads)

    @property
    def first_kv_head(self) -> int:
        # query head h reads KV head h // (H / Hkv); this rank's first query head is
        # rank * H / N, so its KV heads start at rank * Hkv / N (rounded down: replicas)
        return self.rank * self.kv_heads // self.kv_replicas

    @property
    def vocab_per_rank(self) -> int:
        return _ceil_div(self.config.vocab_size, self.world_size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank

    def rank_config(self) -> ModelConfig:
        """The model as this rank builds it: its share of the heads and of the MLP widths.
        ``vocab_size`` stays the whole vocabulary (the width of the gathered logits)."""
        cfg = self.config
        n = self.world_size
        linear = cfg.linear_attention
        if linear is not None:  # Gated DeltaNet heads split like attention heads
            linear = replace(linear, num_key_heads=linear.num_key_heads // n,
                             num_value_heads=linear.num_value_heads // n)
        return replace(cfg, num_heads=self.q_heads, num_kv_heads=self.kv_heads,
                       intermediate_size=cfg.intermediate_size // n,
                       moe_intermediate_size=cfg.moe_intermediate_size // n,
                       linear_attention=linear,
                       shared_expert_intermediate_size=cfg.shared_expert_intermediate_size // n)

    # checkpoint tensors -> this rank's slices

    def shard(self, tensors: Iterator[tuple[str, torch.Tensor]]
              ) -> Iterator[tuple[str, torch.Tensor]]:
        """Each checkpoint tensor as this rank's slice (a copy: the full tensor is freed
        as soon as the next one is read)."""
        for name, tensor in tensors:
            yield name, self.slice(name, tensor)

    def read(self, slices: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's slices read straight from lazily indexed checkpoint tensors
        (safetensors' ``get_slice``: only the bytes of the slice are read)."""
        for name, lazy in slices:
            shape = tuple(lazy.get_shape())
            cut = self.cut(name, shape)
            if cut.zero or not cut.ranges or any(n == 0 for _, n in cut.ranges):
                yield name, self.slice(name, lazy[:])  # whole, tiny, or nothing to take
            else:
                yield name, _apply(cut, shape, lambda index: lazy[index])

    def slice(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of one whole checkpoint tensor (Hugging Face name)."""
        cut = self.cut(name, tuple(tensor.shape))
        if cut.zero:
            return torch.zeros_like(tensor)
        if not cut.ranges:
            return tensor
        return _apply(cut, tuple(tensor.shape), lambda index: tensor[index])

    def cut(self, name: str, shape: tuple[int, ...]) -> Cut:
        """Which part of the checkpoint tensor ``name`` of ``shape`` this rank keeps."""
        cfg = self.config
        r = self.rank
        d = cfg.head_dim
        q_rows = (r * self.q_heads * d, self.q_heads * d)
        kv_start, kv_len = self.first_kv_head * d, self.kv_heads * d
        inter = cfg.intermediate_size // self.world_size
        moe = cfg.moe_intermediate_size // self.world_size
        if cfg.mla is not None and (mla_cut := self._mla_cut(name)) is not None:
            return mla_cut
        if _SHARED_EXPERTS.search(name):  # DeepSeek: an MLP of num_shared_experts * moe
            shared = moe * cfg.num_shared_experts
            return Cut(1 if name.endswith("down_proj.weight") else 0, ((r * shared, shared),))
        if cfg.is_hybrid and (hybrid := self._hybrid_cut(name)) is not None:
            return hybrid
        if _EXPERT_IN.search(name):
            return Cut(0, ((r * moe, moe),))
        if _EXPERT_OUT.search(name):
            return Cut(1, ((r * moe, moe),))
        if _LLAMA4_GATE_UP.search(name):  # Llama 4's [E, H, 2I]: gate columns then up
            half = shape[2] // 2
            return Cut(2, ((r * moe, moe), (half + r * moe, moe)))
        if _LLAMA4_DOWN.search(name):  # Llama 4's [E, I, H]
            return Cut(1, ((r * moe, moe),))
        if _STACKED_GATE_UP.search(name):  # [E, 2I, H]: gate rows then up rows
            half = shape[1] // 2
            return Cut(1, ((r * moe, moe), (half + r * moe, moe)))
        if _STACKED_DOWN.search(name):  # [E, H, I]
            return Cut(2, ((r * moe, moe),))
        if _EXPERT_GATE_UP_BIAS.search(name):  # gpt-oss [E, 2I]: gate then up (gpt_oss.py)
            half = shape[1] // 2
            return Cut(1, ((r * moe, moe), (half + r * moe, moe)))
        if _EXPERT_DOWN_BIAS.search(name):  # summed by the all-reduce: rank 0 only
            return Cut(zero=r != 0)
        if _SINKS.search(name):  # one per query head
            return Cut(0, ((r * self.q_heads, self.q_heads),))
        if _Q.search(name):
            return Cut(0, (q_rows,))
        if _KV.search(name):
            return Cut(0, ((kv_start, kv_len),))
        if _FUSED_QKV.search(name):  # Phi-3 ships q, k, v fused
            q_all, kv_all = cfg.num_heads * d, cfg.num_kv_heads * d
            return Cut(0, (q_rows, (q_all + kv_start, kv_len),
                           (q_all + kv_all + kv_start, kv_len)))
        if _GATE_UP.search(name):  # Llama 4's shared expert is as wide as one expert
            per = moe if _SHARED.search(name) else inter
            return Cut(0, ((r * per, per),))
        if _FUSED_GATE_UP.search(name):  # Phi-3: gate then up
            half = shape[0] // 2
            return Cut(0, ((r * inter, inter), (half + r * inter, inter)))
        if _O_WEIGHT.search(name):
            return Cut(1, (q_rows,))
        if _DOWN_WEIGHT.search(name):
            per = moe if _SHARED.search(name) else inter
            return Cut(1, ((r * per, per),))
        if _ROW_BIAS.search(name):  # summed by the all-reduce: added by rank 0 only
            return Cut(zero=r != 0)
        if _VOCAB.search(name):
            # rows [start, start + V/N), zero-padded past the vocabulary's end (padded ids
            # never occur and their logits are cut off)
            per, start = self.vocab_per_rank, self.vocab_start
            return Cut(0, ((start, max(0, min(per, shape[0] - start))),), pad_to=per)
        return Cut()  # replicated: norms, the router, RoPE factors

    def _mla_cut(self, name: str) -> Cut | None:
        """The head-split tensors of latent attention (None: not one of them)."""
        mla = self.config.mla
        assert mla is not None
        heads, r = self.q_heads, self.rank
        if _MLA_Q.search(name):
            rows = heads * mla.qk_head_dim
            return Cut(0, ((r * rows, rows),))
        if _MLA_KV_B.search(name):
            rows = heads * (mla.qk_nope_head_dim + mla.v_head_dim)
            return Cut(0, ((r * rows, rows),))
        if _O_WEIGHT.search(name):
            cols = heads * mla.v_head_dim
            return Cut(1, ((r * cols, cols),))
        return None


    def _hybrid_cut(self, name: str) -> Cut | None:
        """Qwen3-Next's own tensors (None: cut as the Llama ones). Gated DeltaNet is split
        by key heads, each rank keeping its value heads' state: q/k/v/z and b/a rows come
        grouped per key head (one range), the convolution's channels are q, k, v side by
        side (three ranges; so are Qwen3.5's in_proj_qkv rows, its z, b, a one range
        each), ``out_proj`` is row-parallel. A gated q_proj holds each head's
        query then gate (2 x head_dim rows per head); the shared expert is split as an MLP
        of its own width."""
        cfg = self.config
        linear = cfg.linear_attention
        assert linear is not None
        r, n = self.rank, self.world_size
        if ".linear_attn." in name:
            k_heads = linear.num_key_heads // n
            v_heads = linear.num_value_heads // n
            key, value = k_heads * linear.key_head_dim, v_heads * linear.value_head_dim
            if name.endswith("in_proj_qkvz.weight"):
                rows = 2 * key + 2 * value
                return Cut(0, ((r * rows, rows),))
            if name.endswith("in_proj_ba.weight"):
                return Cut(0, ((r * 2 * v_heads, 2 * v_heads),))
            if name.endswith(("conv1d.weight", "in_proj_qkv.weight")):
                return Cut(0, ((r * key, key), (linear.key_dim + r * key, key),
                               (2 * linear.key_dim + r * value, value)))
            if name.endswith("in_proj_z.weight"):
                return Cut(0, ((r * value, value),))
            if name.endswith(("dt_bias", "A_log", "in_proj_b.weight", "in_proj_a.weight")):
                return Cut(0, ((r * v_heads, v_heads),))
            if name.endswith("out_proj.weight"):
                return Cut(1, ((r * value, value),))
            return Cut()  # the per-head output norm
        if _Q.search(name) and cfg.attn_output_gate:
            rows = self.q_heads * 2 * cfg.head_dim
            return Cut(0, ((r * rows, rows),))
        if ".shared_expert." in name:
            width = cfg.shared_expert_intermediate_size // n
            if _GATE_UP.search(name):
                return Cut(0, ((r * width, width),))
            if _DOWN_WEIGHT.search(name):
                return Cut(1, ((r * width, width),))
        return None

    # LoRA adapters (server/models/lora): each ``A [P * r, in]``, ``B^T [P * r, out]`` cut
    # as its base linear is

    def shard_lora(self, adapter: LoRAAdapter) -> LoRAAdapter:
        """This rank's part of an adapter read whole: column-parallel sites (qkv, gate_up)
        keep their output columns of ``B^T`` and the whole ``A``; row-parallel ones (o,
        down) their input columns of ``A`` and the whole ``B^T``, so each rank's delta is a
        partial sum that the layer's one all-reduce completes with the base output."""
        weights = {}
        for (layer, site), (a, bt) in adapter.weights.items():
            a_cut, bt_cut = self._lora_cuts(site, bt.shape[1])
            weights[(layer, site)] = (_cut(a_cut, a), _cut(bt_cut, bt))
        return LoRAAdapter(adapter.rank, weights)

    def _lora_cuts(self, site: LoRASite, outputs: int) -> tuple[Cut, Cut]:
        """(cut of ``A``, cut of ``B^T``), both along dim 1, as the site's base weight."""
        cfg = self.config
        d = cfg.head_dim
        inter = cfg.intermediate_size // self.world_size
        q_rows = (self.rank * self.q_heads * d, self.q_heads * d)
        if site is LoRASite.QKV:
            q_all, kv_all = cfg.num_heads * d, cfg.num_kv_heads * d
            kv_start, kv_len = self.first_kv_head * d, self.kv_heads * d
            return Cut(), Cut(1, (q_rows, (q_all + kv_start, kv_len),
                                  (q_all + kv_all + kv_start, kv_len)))
        if site is LoRASite.GATE_UP:
            half = outputs // 2
            return Cut(), Cut(1, ((self.rank * inter, inter), (half + self.rank * inter, inter)))
        if site is LoRASite.O:
            return Cut(1, (q_rows,)), Cut()
        return Cut(1, ((self.rank * inter, inter),)), Cut()  # DOWN


@dataclass(frozen=True, slots=True)
class Cut:
    """A rank's part of a checkpoint tensor: ``ranges`` (start, length) along ``dim``,
    concatenated, zero-padded along ``dim`` to ``pad_to``; no ranges: the whole tensor;
    ``zero``: zeros of its shape."""

    dim: int = 0
    ranges: tuple[tuple[int, int], ...] = ()
    pad_to: int | None = None
    zero: bool = False


def _apply(cut: Cut, shape: tuple[int, ...], read: Callable[[tuple[slice, ...]], torch.Tensor]
           ) -> torch.Tensor:
    pieces = []
    for start, length in cut.ranges:
        index = [slice(None)] * len(shape)
        index[cut.dim] = slice(start, start + length)
        pieces.append(read(tuple(index)))
    out = torch.cat(pieces, dim=cut.dim) if len(pieces) > 1 else pieces[0].clone()
    if cut.pad_to is not None and out.shape[cut.dim] < cut.pad_to:
        pad = list(out.shape)
        pad[cut.dim] = cut.pad_to - out.shape[cut.dim]
        out = torch.cat([out, out.new_zeros(pad)], dim=cut.dim)
    return out


def _cut(cut: Cut, tensor: torch.Tensor) -> torch.Tensor:
    return _apply(cut, tuple(tensor.shape), lambda index: tensor[index]) if cut.ranges else tensor


_MLA_Q = re.compile(r"\.(q_proj|q_b_proj)\.weight$")
_MLA_KV_B = re.compile(r"\.kv_b_proj\.weight$")
_SHARED_EXPERTS = re.compile(r"\.shared_experts\.(gate_proj|up_proj|down_proj)\.weight$")
_EXPERT_IN = re.compile(r"\.experts\.\d+\.(w1|w3|gate_proj|up_proj)\.weight$")
_EXPERT_OUT = re.compile(r"\.experts\.\d+\.(w2|down_proj)\.weight$")
_LLAMA4_GATE_UP = re.compile(r"\.feed_forward\.experts\.gate_up_proj$")
_LLAMA4_DOWN = re.compile(r"\.feed_forward\.experts\.down_proj$")
_SHARED = re.compile(r"\.shared_expert\.")
_STACKED_GATE_UP = re.compile(r"\.experts\.gate_up_proj(\.weight)?$")
_STACKED_DOWN = re.compile(r"\.experts\.down_proj(\.weight)?$")
_EXPERT_GATE_UP_BIAS = re.compile(r"\.mlp\.b_gate_up$")
_EXPERT_DOWN_BIAS = re.compile(r"\.mlp\.b_down$")
_SINKS = re.compile(r"\.self_attn\.sinks$")
_Q = re.compile(r"\.q_proj\.(weight|bias)$")
_KV = re.compile(r"\.(k_proj|v_proj)\.(weight|bias)$")
_FUSED_QKV = re.compile(r"\.qkv_proj\.(weight|bias)$")
_GATE_UP = re.compile(r"\.(gate_proj|up_proj)\.(weight|bias)$")
_FUSED_GATE_UP = re.compile(r"\.gate_up_proj\.(weight|bias)$")
_O_WEIGHT = re.compile(r"\.o_proj\.weight$")
_DOWN_WEIGHT = re.compile(r"\.down_proj\.weight$")
_ROW_BIAS = re.compile(r"\.(o_proj|down_proj)\.bias$")
_VOCAB = re.compile(r"(^|\.)(embed_tokens|lm_head)\.weight$")


class VocabParallelEmbedding(nn.Embedding):
    """This rank's rows of the embedding; ids it does not own read a zero row, and the
    all-reduce then adds the owner's row (exact: the other terms are zeros)."""

    def __init__(self, rows: int, hidden: int, start: int, parallel: ParallelContext) -> None:
        super().__init__(rows, hidden)
        self.start = start
        self.parallel = parallel

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        owned = (local >= 0) & (local < self.num_embeddings)
        out = F.embedding(torch.where(owned, local, 0), self.weight)
        out = out * owned.unsqueeze(-1).to(out.dtype)
        return self.parallel.all_reduce(out)


class _RankSlices:
    """A decoder on one rank's slices, with the all-reduces and the logits gather in place.
    Built from the rank's config (:meth:`ShardPlan.rank_config`); mixed in before the
    family's decoder class, whose sublayers named ``_reduced`` end in a row-parallel
    projection."""

    _reduced: tuple[str, ...] = ("self_attn", "mlp")

    def __init__(self, cfg: ModelConfig, plan: ShardPlan, parallel: ParallelContext) -> None:
        super().__init__(replace(cfg, vocab_size=plan.vocab_per_rank))  # type: ignore[call-arg]
        self.config = cfg  # the whole vocabulary: the width of compute_logits' result
        self.parallel = parallel
        self.embed_tokens = VocabParallelEmbedding(plan.vocab_per_rank, cfg.hidden_size,
                                                   plan.vocab_start, parallel)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # Hooks on the sublayers rather than on o_proj / down_proj themselves: platforms
        # swap linears for packed or quantized ones, which would drop a hook.
        for layer in self.layers:
            for name in self._reduced:
                getattr(layer, name).register_forward_hook(self._reduce_output)

    def _reduce_output(self, module: nn.Module, args: object, output: torch.Tensor
                       ) -> torch.Tensor:
        del module, args
        return self.parallel.all_reduce(output)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Every rank's vocabulary slice (scaling and soft caps are elementwise, so they
        commute with the gather), concatenated and trimmed to the real vocabulary."""
        local = super().compute_logits(hidden)  # type: ignore[misc]
        return self.parallel.all_gather_last_dim(local)[..., : self.config.vocab_size]


class TensorParallelCausalLM(_RankSlices, LlamaForCausalLM):
    """``LlamaForCausalLM`` on one rank's slices."""


class TensorParallelQwen3Next(_RankSlices, Qwen3NextForCausalLM):
    """``Qwen3NextForCausalLM`` on one rank's slices: its token mixers (linear or full
    attention) and MLPs all-reduce their outputs."""

    _reduced = ("mixer", "mlp")


def build_model(cfg: ModelConfig, parallel: ParallelContext
                ) -> tuple[LlamaForCausalLM, ModelConfig, ShardPlan | None]:
    """(the model to fill, the config the rank serves with, the plan) for the whole
    model's ``cfg``; the plain model at world size 1."""
    cls = causal_lm_class(cfg)
    if parallel.world_size == 1:
        return cls(cfg), cfg, None
    plan = ShardPlan.build(cfg, parallel.rank, parallel.world_size)
    rank_cfg = plan.rank_config()
    if cfg.is_hybrid:
        return TensorParallelQwen3Next(rank_cfg, plan, parallel), rank_cfg, plan
    return _tensor_parallel_class(cls)(rank_cfg, plan, parallel), rank_cfg, plan


def _tensor_parallel_class(cls: type[LlamaForCausalLM]) -> type[TensorParallelCausalLM]:
    """TensorParallelCausalLM over a family's own decoder class (its __init__ reaches the
    family's through super())."""
    if cls is LlamaForCausalLM:
        return TensorParallelCausalLM
    return type(f"TensorParallel{cls.__name__}", (TensorParallelCausalLM, cls), {})
