"""Which decoder class builds a model: the Llama decoder (llama.py) serves every family of
the registry but the hybrid ones, which have their own (qwen3_next.py)."""

from __future__ import annotations

from server.models.config import ModelConfig
from server.models.llama import LlamaForCausalLM
from server.models.qwen3_next import Qwen3NextForCausalLM


def new_model(cfg: ModelConfig) -> LlamaForCausalLM | Qwen3NextForCausalLM:
    """The decoder of ``cfg``'s family, built on the current default device."""
    return Qwen3NextForCausalLM(cfg) if cfg.is_hybrid else LlamaForCausalLM(cfg)
