"""Which decoder class builds a model: the Llama decoder of llama.py, or a family's subclass
of it (its own layers, checkpoint layout and forward)."""

from __future__ import annotations

from server.models.config import ModelConfig
from server.models.llama import LlamaForCausalLM
from server.models.llama4 import Llama4ForCausalLM

# ModelConfig.model_type -> the family's class; every other family is the Llama decoder
_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "llama4_text": Llama4ForCausalLM,
}


def causal_lm_class(cfg: ModelConfig) -> type[LlamaForCausalLM]:
    return _CLASSES.get(cfg.model_type, LlamaForCausalLM)
