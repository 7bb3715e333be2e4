"""PEFT adapters for the tiny models, and the reference: transformers with the adapter
merged into the base weights (PEFT's ``merge_and_unload``)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import GenerationConfig

LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PHI3_TARGETS = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]


def save_adapter(model, path: Path, rank: int, targets: list[str], seed: int,
                 alpha: int | None = None, rslora: bool = False) -> str:
    """A PEFT LoRA of ``model`` with random, non-zero B (PEFT starts B at zero: the
    adapter would change nothing)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    peft_model = get_peft_model(copy.deepcopy(model), LoraConfig(
        r=rank, lora_alpha=alpha or 2 * rank, target_modules=targets, use_rslora=rslora,
        lora_dropout=0.0))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.5)
    peft_model.save_pretrained(path)
    return str(path)


def merged(model, adapter: str):
    """The reference model for an adapter: PEFT merges it into a copy of the base."""
    from peft import PeftModel

    return PeftModel.from_pretrained(copy.deepcopy(model), adapter).merge_and_unload().eval()


def hf_greedy(model, prompt_ids: list[int], new_tokens: int) -> list[int]:
    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), generation_config=config)
    return out[0, len(prompt_ids):].tolist()


@pytest.fixture(scope="session")
def adapter_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., str]:
    cache: dict[tuple, str] = {}

    def make(model, rank: int, targets: list[str] | None = None, seed: int = 0,
             **kwargs) -> str:
        key = (id(model), rank, tuple(targets or LLAMA_TARGETS), seed,
               tuple(sorted(kwargs.items())))
        if key not in cache:
            cache[key] = save_adapter(model, tmp_path_factory.mktemp("adapter"), rank,
                                      targets or LLAMA_TARGETS, seed, **kwargs)
        return cache[key]

    return make
