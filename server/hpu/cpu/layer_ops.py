"""Eager CPU layer ops: each fusable operation as one call into ``torch.ops.hpu_serve``.

On CPU, per-op dispatch, not arithmetic, dominates small decode batches. The fused norms,
RoPE and SiLU round exactly where the PyTorch expressions round, so both give the same bf16
values; attention differs in the last bits only: the kernel keeps scores in fp32 where the
flat path rounds them to the model dtype.

Every attention variant of the registry's families runs in the kernels: per-layer sliding
windows and attention chunks (blocks before the window or chunk are not even read),
soft-capped scores (Gemma 2), attention sinks (gpt-oss: a per-head logit in every softmax's
denominator), any
head size (64, 96, 128 and 256 on compiled fast paths), fp8 e4m3 KV caches (written with
PyTorch's rounding, widened as they are read) and partial rotary embeddings.
"""

from __future__ import annotations

import torch

from server.hpu.attention import AttentionMetadata
from server.hpu.cpu.decode_stack import FusedDecodeStack
from server.hpu.kv_cache import KVCache
from server.hpu.layer_ops import Rope, TorchLayerOps
from server.hpu.layer_stack import LayerStackSpec
from server.hpu.types import DecodeLayout


class FusedCpuLayerOps(TorchLayerOps):
    """Eager CPU backend: one kernel call per fused operation (needs the ops loaded by
    ``server.hpu.cpu.kernels.load_cpu_kernels``)."""

    name = "fused-cpu"
    # Decode metadata: per-row block tables and lengths, read in place by the kernel.
    decode_layout = DecodeLayout.BLOCK_TABLES
    dtypes = (torch.float32, torch.bfloat16)  # what the kernels are compiled for
    # KV caches the kernels read and write besides the model's dtype (unscaled, as the
    # engine stores them: see server/engine/worker/model_runner.py kv_cache_dtype)
    kv_dtypes = (torch.float8_e4m3fn,)
    lora_kernel = True  # csrc/lora_kernels.cpp, built into the same library

    def can_serve(self, kv_dtype: torch.dtype, attn_softcap: float | None,
                  window: int | None = None, partial_rotary: bool = False) -> bool:
        # windows, score caps and partial rotary all run in the kernels; a cache dtype
        # they are not compiled for (float16, fp8 e5m2) does not
        return kv_dtype in self.dtypes or kv_dtype in self.kv_dtypes

    def kv_cache_views(self, kv_caches: list[KVCache]) -> list[KVCache]:
        """Keys transposed within each block, ``[blocks, Hkv, D, B]`` (see the kernels'
        header): the same zero-filled memory, so this is only valid before any write."""
        return [(k.view(k.shape[0], k.shape[1], k.shape[3], k.shape[2]), v)
                for k, v in kv_caches]

    def decode_stack(self, spec: LayerStackSpec) -> FusedDecodeStack | None:
        # every layer in one kernel call (csrc/decode_stack.cpp): the same kernels, no Python
        return FusedDecodeStack.build(spec)

    def __init__(self) -> None:
        ops = torch.ops.hpu_serve
        self._rms_norm = ops.rms_norm.default
        self._add_rms_norm = ops.add_rms_norm_.default
        self._silu_and_mul = ops.silu_and_mul.default
        self._gelu_tanh_and_mul = ops.gelu_tanh_and_mul.default
        self._rotary = ops.rotary_write_kv.default
        self._attention = ops.decode_attention.default
        self._prefill_attention = ops.prefill_attention.default
        self._argmax = ops.argmax.default

    @staticmethod
    def _kernel_weight(x: torch.Tensor, weight: torch.Tensor) -> bool:
        # x's dtype, or Gemma's float32 weights under bf16 activations
        return weight.dtype == x.dtype or (weight.dtype == torch.float32
                                           and x.dtype == torch.bfloat16)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if not self._kernel_weight(x, weight):
            return super().rms_norm(x, weight, eps)
        return self._rms_norm(x.contiguous(), weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        if not self._kernel_weight(x, weight):
            return super().add_rms_norm(x, residual, weight, eps)
        residual = residual.contiguous()  # updated in place: the caller's copy is the stream
        return self._add_rms_norm(residual, x.contiguous(), weight, eps), residual

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self._silu_and_mul(x.contiguous())

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self._gelu_tanh_and_mul(x.contiguous())

    def rotary_write_kv(self, qkv: torch.Tensor, rope: Rope, kv_cache: KVCache,
                        meta: AttentionMetadata, num_heads: int, num_kv_heads: int
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        qkv = qkv.contiguous()
        tokens = qkv.shape[0]
        cos, sin = rope
        self._rotary(qkv, cos.view(tokens, -1), sin.view(tokens, -1), kv_cache[0], kv_cache[1],
                     meta.slot_mapping, num_heads, num_kv_heads)
        heads = qkv.view(tokens, num_heads + 2 * num_kv_heads, -1)
        return (heads[:, :num_heads], heads[:, num_heads : num_heads + num_kv_heads],
                heads[:, num_heads + num_kv_heads :])

    # Up to this prompt length the paged kernel (one row per token, keys read from the
    # cache just written) beats PyTorch's CPU flash attention. Measured on SmolLM2, whole
    # prefill steps: 1.13x faster at 200 tokens, 1.14x at 512, 0.96x at 1000.
    kernel_prompt_max = 768

    def prompt_attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         kv_cache: KVCache, meta: AttentionMetadata, bs: int, scale: float,
                         softcap: float | None = None, window: int | None = None,
                         chunk: int | None = None, sinks: torch.Tensor | None = None
                         ) -> torch.Tensor:
        if meta.image_ends is not None:
            # bidirectional image tokens (Gemma 3): the kernel's rows see a causal prefix
            # only, so such a step (never packed) takes the masked PyTorch paths, reading
            # the keys through a view of this backend's transposed blocks
            return self.masked_prompt_attention(query, key, value, kv_cache[0].transpose(2, 3),
                                                kv_cache[1], meta, bs, scale, softcap, window,
                                                chunk, sinks)
        # after a cached prefix the kernel reads it from the cache, however long (measured
        # on SmolLM2 with a 1,000-token prefix: 1.35 s per hit, against 1.7 s for PyTorch's
        # masked attention over the gathered blocks and 4.4 s for an unfused one)
        if meta.block_tables is None or (query.shape[0] // bs > self.kernel_prompt_max
                                         and not meta.has_context and not meta.packed):
            return super().prompt_attention(query, key, value, kv_cache, meta, bs, scale,
                                            softcap, window, chunk, sinks=sinks)
        if self._tiled(query, kv_cache, softcap, window, chunk, sinks):
            assert meta.block_tables is not None and meta.seq_lens is not None
            return self._prefill_attention(query, kv_cache[0], kv_cache[1], meta.block_tables,
                                           meta.seq_lens, scale, self.prefill_min_run)
        return self.decode_attention(query, kv_cache, meta, scale, softcap, window, chunk,
                                     sinks=sinks)

    # Runs of at least this many consecutive tokens of one sequence take the tiled prefill
    # kernel (csrc/prefill_attention.cpp); shorter ones, decodes among them, the paged one.
    prefill_min_run = 16

    def _tiled(self, query: torch.Tensor, kv_cache: KVCache, softcap: float | None,
               window: int | None, chunk: int | None, sinks: torch.Tensor | None) -> bool:
        """The plain case the tiled kernel serves: no window, chunk, cap or sinks, the cache in
        the model's dtype, heads of a multiple of 64, blocks of a multiple of 16."""
        return (not softcap and window is None and chunk is None and sinks is None
                and kv_cache[0].dtype == query.dtype and query.shape[-1] % 64 == 0
                and kv_cache[1].shape[2] % 16 == 0 and query.shape[0] >= self.prefill_min_run)

    def decode_attention(self, query: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata,
                         scale: float, softcap: float | None = None, window: int | None = None,
                         chunk: int | None = None, sinks: torch.Tensor | None = None
                         ) -> torch.Tensor:
        assert meta.block_tables is not None and meta.seq_lens is not None
        # 0: no window / no cap / no chunk (the op's schema takes plain numbers); sinks in fp32
        return self._attention(query, kv_cache[0], kv_cache[1], meta.block_tables,
                               meta.seq_lens, scale, window or 0, softcap or 0.0,
                               chunk=chunk or 0,
                               sinks=None if sinks is None else sinks.float().contiguous())

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        # PyTorch's CPU argmax is a scalar loop: 64 x 49k logits took 2.0 ms against 0.23.
        return self._argmax(logits.contiguous())
