"""GGUF files of the families llama.cpp exports beyond Llama / Qwen (Phi-3 and Phi-4-mini's
partial rotary, Gemma 2 and 3, Qwen3-MoE, Mixtral and Mistral as "llama"), written here in llama.cpp's layouts from tiny
random transformers models: our loader must give transformers' logits and greedy tokens on
the original fp32 weights, and, where transformers can read the same file, its logits."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from gguf_files import header_only_gguf, write_gguf
from test_llama import PHI3_LONGROPE, PROMPT_LENS, run_prefill_then_decode
from transformers import GenerationConfig

from server.models.loader import load_model, resolve_model_source

STEPS = 6


def scaled(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """As conftest's tiny models: matrices x3 so greedy choices are not coin flips, norms
    random (not all ones: a swapped, skipped or offset norm shows)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() in (2, 3):
                p.mul_(3.0)
            elif name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(seed))
    return model.eval()


def gemma2(head_dim: int = 32, caps: tuple[float, float] = (5.0, 3.0), **extra) -> torch.nn.Module:
    """Gemma 2 with llama.cpp's score scale (query_pre_attn_scalar == head_dim, as in the
    2B and 9B models) and strong soft caps."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Gemma2Config(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
        query_pre_attn_scalar=head_dim, attn_logit_softcapping=caps[0],
        final_logit_softcapping=caps[1], max_position_embeddings=512, **extra)
    return scaled(transformers.Gemma2ForCausalLM(cfg))


def gemma3(head_dim: int = 32, scaling: dict | None = None, final_cap: float | None = 3.0,
           **extra) -> torch.nn.Module:
    """Gemma 3 text as llama.cpp reads it: seven layers in its fixed pattern (five windowed,
    the 6th global, the 7th windowed again), an 8-token window, the local RoPE base 10000
    beside a global 1M one, the score scale 1/sqrt(head_dim) (query_pre_attn_scalar ==
    head_dim, as in the 1B-12B models)."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Gemma3TextConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=7,
        num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
        query_pre_attn_scalar=head_dim, sliding_window=8, sliding_window_pattern=6,
        rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, rope_scaling=scaling,
        final_logit_softcapping=final_cap, max_position_embeddings=512, **extra)
    return scaled(transformers.Gemma3ForCausalLM(cfg))


# Phi-4-mini's RoPE in small: LongRoPE over 12 of the 16 head dims (partial_rotary_factor
# 0.75, as Phi-4-mini's 96 of 128), so 6 factors per kind
PHI4_MINI_LONGROPE = dict(rope_type="longrope", short_factor=[1.0 + i / 8 for i in range(6)],
                          long_factor=[2.0 + i / 4 for i in range(6)])


def qwen3_moe(num_experts: int = 6, moe_intermediate_size: int = 48) -> torch.nn.Module:
    """Qwen3-MoE as the real models are (every layer sparse, top-k weights renormalised:
    llama.cpp assumes both), head size != hidden / heads."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=num_experts,
        num_experts_per_tok=2, moe_intermediate_size=moe_intermediate_size, norm_topk_prob=True,
        max_position_embeddings=512, tie_word_embeddings=False)
    return scaled(transformers.Qwen3MoeForCausalLM(cfg))


def gguf_folder(tmp_path: Path, hf_model: torch.nn.Module, arch: str, **kwargs) -> str:
    folder = tmp_path / arch
    folder.mkdir()
    write_gguf(folder / f"tiny-{arch}.gguf", hf_model, arch=arch, **kwargs)
    return str(folder)


def assert_matches(folder: str, hf_model: torch.nn.Module) -> None:
    """Four prompts prefilled as a batch, then decoded greedily: our logits equal
    transformers' at every step, and our greedy tokens are transformers' own."""
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, hf_model.config.vocab_size, (n,), generator=gen).tolist()
               for n in PROMPT_LENS]
    seqs, ours = run_prefill_then_decode(folder, prompts, steps=STEPS)
    for row, seq in enumerate(seqs):
        with torch.no_grad():
            ref = hf_model(torch.tensor([seq.all_token_ids])).logits[0].float()
            greedy = hf_model.generate(torch.tensor([prompts[row]]), GenerationConfig(
                max_new_tokens=STEPS, do_sample=False, eos_token_id=None, pad_token_id=0))
        assert seq.output_token_ids == greedy[0, len(prompts[row]):].tolist()
        for step, logits in enumerate(ours):
            torch.testing.assert_close(logits[row], ref[len(prompts[row]) - 1 + step],
                                       atol=2e-4, rtol=1e-4)


def test_phi3_gguf_with_longrope_factors(tiny_model_factory, tmp_path: Path) -> None:
    """Fused attn_qkv, ffn_up holding gate and up, LongRoPE's factors as rope_factors_*
    tensors; the 30-token prompt and decode pass the 64-token original context, where the
    long factors take over."""
    _, hf_model, _ = tiny_model_factory(model_type="phi3", tie=False, num_kv_heads=2,
                                        rope_scaling=PHI3_LONGROPE)
    folder = gguf_folder(tmp_path, hf_model, "phi3")
    loaded = load_model(resolve_model_source(folder), "float32", torch.device("cpu"))
    scaling = loaded.config.rope_scaling
    assert scaling["rope_type"] == "longrope"
    assert scaling["long_factor"] == PHI3_LONGROPE["long_factor"]
    assert scaling["original_max_position_embeddings"] == 64
    assert_matches(folder, hf_model)


def test_gemma2_gguf_norms_caps_and_scale(tmp_path: Path) -> None:
    """Norms stored as 1 + w (no offset to add again), the soft caps from the header,
    llama.cpp's 1/sqrt(head_dim) score scale, the tied head."""
    hf_model = gemma2()
    folder = gguf_folder(tmp_path, hf_model, "gemma2")
    cfg = load_model(resolve_model_source(folder), "float32", torch.device("cpu")).config
    assert (cfg.attn_softcap, cfg.final_softcap, cfg.norm_offset) == (5.0, 3.0, 0.0)
    assert cfg.tie_word_embeddings and cfg.sandwich_norms
    assert_matches(folder, hf_model)


def test_gemma2_27b_score_scale_follows_llama_cpp(tmp_path: Path) -> None:
    """llama.cpp derives Gemma 2's score scale from the model size (the header has no
    query_pre_attn_scalar): 46 layers (27B) use hidden / heads, the others head_dim."""
    import gguf

    from server.models.gguf import gguf_model_config

    for layers, scalar in ((46, 4608 // 32), (42, 128)):  # hidden/heads 144, head 128
        path = header_only_gguf(tmp_path / f"gemma2-{layers}.gguf", "gemma2", block_count=layers,
                                context_length=8192, embedding_length=4608, head_count=32,
                                feed_forward_length=36864, vocab_size=8, key_length=128,
                                head_count_kv=16)
        cfg = gguf_model_config(gguf.GGUFReader(str(path)))
        assert cfg.attention_multiplier == pytest.approx(scalar ** -0.5)
        assert cfg.embedding_multiplier == pytest.approx(math.sqrt(4608))


def test_qwen3_moe_gguf_stacked_experts(tmp_path: Path) -> None:
    """Router ffn_gate_inp, experts as ffn_gate_exps / ffn_up_exps / ffn_down_exps stacked
    per layer, expert counts and size in the header."""
    hf_model = qwen3_moe()
    folder = gguf_folder(tmp_path, hf_model, "qwen3moe")
    cfg = load_model(resolve_model_source(folder), "float32", torch.device("cpu")).config
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (6, 2, 48)
    assert cfg.moe_layers == (0, 1) and cfg.norm_topk_prob
    assert_matches(folder, hf_model)


def test_mixtral_gguf_is_llama_with_experts(tiny_model_factory, tmp_path: Path) -> None:
    """llama.cpp writes Mixtral as general.architecture "llama" (permuted Q/K rows) plus
    expert tensors: it loads as Mixtral (renormalised top-2), not refused."""
    _, hf_model, _ = tiny_model_factory(model_type="mixtral", tie=False, num_kv_heads=2)
    folder = gguf_folder(tmp_path, hf_model, "llama")
    cfg = load_model(resolve_model_source(folder), "float32", torch.device("cpu")).config
    assert cfg.model_type == "mixtral" and cfg.num_experts == 8 and cfg.norm_topk_prob
    assert_matches(folder, hf_model)


def test_gemma3_gguf_pattern_local_rope_and_qk_norms(tmp_path: Path) -> None:
    """Gemma 3 as llama.cpp's converter writes it ("gemma3"): every norm stored as 1 + w,
    q/k norms included; the header's base and linear scaling for the global layers only,
    the windowed ones on the unscaled 10000 base; windows by llama.cpp's pattern of six.
    Prompts run past the 8-token window, so windowing or rotating any layer the wrong way
    changes the logits."""
    hf_model = gemma3(scaling=dict(rope_type="linear", factor=8.0))
    assert hf_model.config.layer_types[5] == "full_attention"  # transformers' own pattern
    folder = gguf_folder(tmp_path, hf_model, "gemma3")
    cfg = load_model(resolve_model_source(folder), "float32", torch.device("cpu")).config
    assert cfg.model_type == "gemma3_text" and cfg.qk_norm and cfg.norm_offset == 0.0
    assert [cfg.layer_window(i) for i in range(7)] == [8] * 5 + [None, 8]
    assert (cfg.rope_theta, cfg.local_rope_theta, cfg.local_rope_scaling) == (1e6, 1e4, None)
    assert cfg.rope_scaling == dict(rope_type="linear", factor=8.0)
    assert (cfg.attn_softcap, cfg.final_softcap) == (None, 3.0)
    assert max(PROMPT_LENS) > 8
    assert_matches(folder, hf_model)


def test_gemma3_27b_score_scale_follows_llama_cpp(tmp_path: Path) -> None:
    """As for Gemma 2: without query_pre_attn_scalar in the header llama.cpp scales the
    62-layer 27B by hidden / heads (168, its config's scalar), the others by head_dim."""
    import gguf

    from server.models.gguf import gguf_model_config

    for layers, scalar in ((62, 5376 // 32), (34, 256)):
        path = header_only_gguf(tmp_path / f"gemma3-{layers}.gguf", "gemma3", block_count=layers,
                                context_length=8192, embedding_length=5376, head_count=32,
                                feed_forward_length=21504, vocab_size=8, key_length=256,
                                head_count_kv=16, sliding_window=1024)
        cfg = gguf_model_config(gguf.GGUFReader(str(path)))
        assert cfg.attention_multiplier == pytest.approx(scalar ** -0.5)
        assert cfg.sliding_layers == tuple(i for i in range(layers) if i % 6 != 5)


def test_mistral_gguf_is_llama(tiny_model_factory, tmp_path: Path) -> None:
    """llama.cpp's converter writes Mistral as "llama" (Q/K rows permuted), without its
    sliding window: no such key for "llama", which llama.cpp runs with full attention. So
    this is a window-less Mistral (any Mistral GGUF serves as llama.cpp serves it)."""
    _, hf_model, _ = tiny_model_factory(model_type="mistral", tie=False, num_kv_heads=2)
    assert hf_model.config.sliding_window is None
    folder = gguf_folder(tmp_path, hf_model, "llama")
    cfg = load_model(resolve_model_source(folder), "float32", torch.device("cpu")).config
    assert cfg.model_type == "llama" and cfg.sliding_window is None
    assert_matches(folder, hf_model)


def test_phi4_mini_gguf_partial_rotary(tiny_model_factory, tmp_path: Path) -> None:
    """Phi-4-mini: "phi3" with rope.dimension_count below the head size (12 of 16 here),
    LongRoPE factors over the rotated dims only; the 30-token prompt passes the 64-token
    original context, so both the partial rotation and the long factors show."""
    _, hf_model, _ = tiny_model_factory(model_type="phi3", tie=False, num_kv_heads=2,
                                        rope_scaling=PHI4_MINI_LONGROPE,
                                        config_kwargs=dict(partial_rotary_factor=0.75))
    folder = gguf_folder(tmp_path, hf_model, "phi3")
    cfg = load_model(resolve_model_source(folder), "float32", torch.device("cpu")).config
    assert (cfg.head_dim, cfg.rotary_dim) == (16, 12)
    assert cfg.rope_scaling["long_factor"] == PHI4_MINI_LONGROPE["long_factor"]
    assert_matches(folder, hf_model)


def test_partial_rotary_refused_where_llama_cpp_permutes(tmp_path: Path) -> None:
    """A "llama" file's Q/K rows are permuted for llama.cpp's adjacent-pair RoPE; a partial
    share there is no layout transformers has, so it is refused rather than misread."""
    import gguf

    from server.models.gguf import gguf_model_config

    path = header_only_gguf(tmp_path / "partial-llama.gguf", "llama", block_count=1,
                            context_length=64, embedding_length=64, head_count=4,
                            feed_forward_length=128, vocab_size=8, key_length=16,
                            rope_dimension_count=8)
    with pytest.raises(ValueError, match="RoPE over 8 of 16"):
        gguf_model_config(gguf.GGUFReader(str(path)))


def transformers_reading(folder: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    name = next(Path(folder).glob("*.gguf")).name
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                dtype=torch.float32).eval()


@pytest.mark.parametrize("arch", ["phi3", "gemma2", "gemma3", "qwen3moe"])
def test_transformers_reads_the_same_gguf(tiny_model_factory, tmp_path: Path, arch: str
                                          ) -> None:
    """An independent reading of the same file (transformers' GGUF loader) gives our
    logits. Its readers take fewer header keys than llama.cpp writes (no LongRoPE factors,
    Gemma 2's caps and score scale at the real models' defaults, Gemma 3's too and no RoPE
    scaling, Qwen3-MoE's expert size at 768), so these models use the values it assumes."""
    if arch == "phi3":
        hf_model = tiny_model_factory(model_type="phi3", tie=False, num_kv_heads=2)[1]
    elif arch == "gemma2":
        hf_model = gemma2(head_dim=256, caps=(50.0, 30.0))
    elif arch == "gemma3":
        hf_model = gemma3(head_dim=256, final_cap=None)
    else:
        hf_model = qwen3_moe(num_experts=4, moe_intermediate_size=768)
    folder = gguf_folder(tmp_path, hf_model, arch)
    theirs = transformers_reading(folder)
    ids = torch.randint(3, 320, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        original = hf_model(ids).logits[0, -1]
        read = theirs(ids).logits[0, -1]
    torch.testing.assert_close(read, original, atol=2e-4, rtol=1e-4)  # it read it all
    seqs, ours = run_prefill_then_decode(folder, [ids[0].tolist()], steps=0)
    torch.testing.assert_close(ours[0][0], read, atol=2e-4, rtol=1e-4)


def test_gemma2_gguf_alternates_windowed_and_global_layers(tmp_path: Path) -> None:
    """llama.cpp's Gemma 2 pattern: even layers windowed, odd ones global (transformers'
    layer_types); prompts run past the 8-token window, so windowing every layer (or none)
    would change the logits."""
    hf_model = gemma2(sliding_window=8)
    folder = gguf_folder(tmp_path, hf_model, "gemma2")
    cfg = load_model(resolve_model_source(folder), "float32", torch.device("cpu")).config
    assert [cfg.layer_window(i) for i in range(cfg.num_layers)] == [8, None]
    assert max(PROMPT_LENS) > 8
    assert_matches(folder, hf_model)
