"""Which weights to serve and how to hold them; the paged KV cache's geometry and budget."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from server.config.fields import flag, knob, section

GiB = 1 << 30

HUB = "models from the Hugging Face Hub (an org/name model argument)"
# The generation config's sampling fields that become request defaults (vLLM's list;
# max_new_tokens is the default max_tokens)
GENERATION_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                     "max_new_tokens")


@dataclass(frozen=True, slots=True)
class HubOptions:
    """Where a model named by its Hub id comes from (vLLM's flags, huggingface_hub's cache)."""

    revision: str | None = flag(
        None, group=HUB, help="branch, tag or commit of a model given by its Hub id (default: "
                              "main)")
    download_dir: str | None = flag(
        None, group=HUB, help="the Hugging Face cache folder that holds (and receives) Hub "
                              "models (default: HF_HUB_CACHE, else HF_HOME/hub, else "
                              "~/.cache/huggingface/hub)")
    offline: bool = knob(
        False, env="HF_HUB_OFFLINE",
        help="never contact the Hub: a model id loads from the cache only (set it where the "
             "machine has no network, for a fast and certain answer)")


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
        None, aliases=("-q",), choices=("gguf", "none", "gptq", "awq", "fp8", "compressed-tensors",
                                      "mxfp4"),
        help="gguf (default for .gguf files): Q4_0/Q4_1 weights stay 4-bit for decode batches "
             "of up to 4 rows (bf16 on CPU); none: dequantize everything to --dtype; gptq, "
             "awq, fp8, compressed-tensors, mxfp4 (gpt-oss experts): what config.json says the "
             "checkpoint is (read from it when unset; dequantized at load)")
    generation_config: str = flag(
        "auto", help="request defaults for sampling fields a request leaves unset: auto: the "
                     "model's generation_config.json (temperature, top_p, top_k, min_p, "
                     "repetition_penalty; max_new_tokens as max_tokens), or a GGUF's "
                     "general.sampling.* keys; vllm: none (the API's own defaults); a folder: "
                     "that folder's generation_config.json")
    override_generation_config: str | None = flag(
        None, help="JSON object of generation config fields applied over --generation-config "
                   "(e.g. '{\"temperature\": 0.5}')")
    hub: HubOptions = section(HubOptions)

    def __post_init__(self) -> None:
        _ = self.generation_overrides  # a bad JSON stops start-up here, in one line

    @property
    def generation_overrides(self) -> dict[str, Any]:
        """--override-generation-config as a dict, its fields checked."""
        if not self.override_generation_config:
            return {}
        try:
            value = json.loads(self.override_generation_config)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--override-generation-config is no JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError("--override-generation-config must be a JSON object")
        unknown = sorted(set(value) - set(GENERATION_FIELDS))
        if unknown:
            raise ValueError(f"--override-generation-config: unknown field(s) "
                             f"{', '.join(unknown)} (known: {', '.join(GENERATION_FIELDS)})")
        return value


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
