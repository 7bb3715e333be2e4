"""Tiny EAGLE / EAGLE-3 heads for a tiny target, saved as vLLM loads them: config.json
(``LlamaForCausalLM`` of one layer for EAGLE-1, ``LlamaForCausalLMEagle3`` with a
``draft_vocab_size`` for EAGLE-3) and safetensors named ``fc.*``, ``layers.0.*`` (EAGLE-1)
or ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d`` (EAGLE-3)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def save_head(target: str, folder: Path, method: str, seed: int = 0,
              copies_embedding: bool = False) -> str:
    """A random head for the target at ``target``. ``copies_embedding`` (EAGLE-1): fc
    passes the token's embedding through and the layer adds nothing, so the head proposes
    the target's LM head over the current token's embedding."""
    cfg = json.loads((Path(target) / "config.json").read_text())
    hidden, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = hidden // heads
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.1

    eagle3 = method == "eagle3"
    layer = "midlayer." if eagle3 else "layers.0."
    attn_in = 2 * hidden if eagle3 else hidden
    tensors = {
        f"{layer}self_attn.q_proj.weight": rand(heads * head_dim, attn_in),
        f"{layer}self_attn.k_proj.weight": rand(kv_heads * head_dim, attn_in),
        f"{layer}self_attn.v_proj.weight": rand(kv_heads * head_dim, attn_in),
        f"{layer}self_attn.o_proj.weight": rand(hidden, heads * head_dim),
        f"{layer}mlp.gate_proj.weight": rand(inter, hidden),
        f"{layer}mlp.up_proj.weight": rand(inter, hidden),
        f"{layer}mlp.down_proj.weight": rand(hidden, inter),
        f"{layer}post_attention_layernorm.weight": 1 + rand(hidden),
        "fc.weight": rand(hidden, (3 if eagle3 else 2) * hidden),
    }
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": 1,
              "num_attention_heads": heads, "num_key_value_heads": kv_heads,
              "vocab_size": vocab, "rms_norm_eps": cfg.get("rms_norm_eps", 1e-6),
              "rope_theta": cfg.get("rope_theta", 10000.0),
              "max_position_embeddings": cfg["max_position_embeddings"],
              "torch_dtype": "float32"}
    if eagle3:
        draft_vocab = vocab // 2
        # the draft vocabulary: half of the target's ids, in order (d2t: the offsets)
        ids = torch.randperm(vocab, generator=gen)[:draft_vocab].sort().values
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[ids] = True
        tensors |= {f"{layer}input_layernorm.weight": 1 + rand(hidden),
                    f"{layer}hidden_norm.weight": 1 + rand(hidden),
                    "norm.weight": 1 + rand(hidden),
                    "lm_head.weight": rand(draft_vocab, hidden) * 10,
                    "d2t": ids - torch.arange(draft_vocab), "t2d": t2d}
        config |= {"architectures": ["LlamaForCausalLMEagle3"],
                   "draft_vocab_size": draft_vocab}
    if copies_embedding:
        tensors["fc.weight"] = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], 1)
        tensors[f"{layer}self_attn.o_proj.weight"].zero_()
        tensors[f"{layer}mlp.down_proj.weight"].zero_()
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)
