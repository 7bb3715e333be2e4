"""Which weights to serve and how to hold them; the paged KV cache's geometry and budget."""

from __future__ import annotations

from dataclasses import dataclass

from server.config.fields import flag, knob

GiB = 1 << 30


@dataclass(frozen=True, slots=True)
class ModelOptions:
    """Which weights to serve and how to hold them."""

    model: str | None = flag(
        None, positional=True,
        help="HF folder or .gguf file; default: embedded SmolLM2-135M-Instruct")
    dtype: str = flag("auto", choices=("auto", "bfloat16", "float16", "float32"),
                      help="dtype of weights and activations (auto: the checkpoint's; bfloat16 "
                           "for GGUF files and, on CPU, for float16 checkpoints)")
    served_model_name: str | None = flag(
        None, help="the model's name in the API (default: taken from the model path)")
    chat_template: str | None = flag(None, help="Jinja template or a file with one")
    seed: int = flag(0, help="seed of random sampling")
    quantization: str | None = flag(
        None, aliases=("-q",), choices=("gguf", "none", "gptq", "awq", "fp8", "compressed-tensors"),
        help="gguf (default for .gguf files): Q4_0/Q4_1 weights stay 4-bit for decode batches "
             "of up to 4 rows (bf16 on CPU); none: dequantize everything to --dtype; gptq, "
             "awq, fp8, compressed-tensors: what config.json says the checkpoint is (read from "
             "it when unset; dequantized at load)")


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Paged KV cache geometry and budget."""

    block_size: int = flag(128, help="tokens per KV cache block")
    gpu_memory_utilization: float = flag(
        0.9, help="fraction of the device's memory this server may use (weights, KV cache, "
                  "graphs)")
    # CPU has no "free device memory" to take a fraction of: an explicit bound instead.
    cpu_kvcache_space_bytes: int = knob(4 * GiB, env="VLLM_CPU_KVCACHE_SPACE", unit=GiB,
                                        help="KV cache size on CPU, in GiB")
    num_blocks_override: int | None = flag(
        None, name="num-gpu-blocks-override",
        help="KV cache blocks, instead of what the memory budget holds")
    kv_cache_dtype: str = flag(
        "auto", choices=("auto", "fp8", "fp8_e4m3"),
        help="auto: the model's dtype; fp8: store K/V as float8 e4m3 (half the bytes of bf16), "
             "upcast in attention; on CPU this runs PyTorch attention, not the fused kernels")
    enable_prefix_caching: bool = flag(
        True, help="reuse the KV blocks of a prompt prefix computed before (full blocks, "
                   "chained hashes)")

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"--block-size must be >= 1, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("--gpu-memory-utilization must be in (0, 1]")
        if self.num_blocks_override is not None and self.num_blocks_override < 1:
            raise ValueError("--num-gpu-blocks-override must be >= 1")
