"""Which decoder class builds a model: the Llama decoder of llama.py, a family's subclass
of it (its own layers, checkpoint layout and forward), or the hybrid models' own decoder
(qwen3_next.py)."""

from __future__ import annotations

from server.models.config import ModelConfig
from server.models.llama import LlamaForCausalLM
from server.models.llama4 import Llama4ForCausalLM
from server.models.qwen3_next import Qwen3NextForCausalLM

# ModelConfig.model_type -> the family's class; every other family is the Llama decoder
_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "llama4_text": Llama4ForCausalLM,
}


def causal_lm_class(cfg: ModelConfig) -> type[LlamaForCausalLM] | type[Qwen3NextForCausalLM]:
    if cfg.is_hybrid:  # Qwen3-Next and Qwen3.5: linear-attention layers with a state cache
        return Qwen3NextForCausalLM
    return _CLASSES.get(cfg.model_type, LlamaForCausalLM)
