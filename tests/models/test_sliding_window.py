"""Sliding-window attention, Gemma 3 and partial rotary embeddings against transformers, on
sequences several windows long, so that windowed layers really drop keys: logits at every
prefill and decode step, then greedy tokens through the engine (prefix cache included)."""

from __future__ import annotations

import pytest
import torch
from test_llama import assert_logits_match
from transformers import GenerationConfig

from server import LLM, SamplingParams

WINDOW = 16
# prefilled together as one padded batch, then decoded 14 steps: up to 55 tokens, > 3 windows
LONG_PROMPTS = (5, 23, 41, 12)
STEPS = 14

CASES = {
    # sliding layers 0 and 1, global layer 2, two RoPE tables, q/k norms
    "gemma3": dict(model_type="gemma3_text", sliding_window=WINDOW, tie=True, num_kv_heads=2),
    # even layers windowed, score and logit soft caps
    "gemma2": dict(model_type="gemma2", sliding_window=WINDOW, tie=True, num_kv_heads=2),
    # one window for every layer
    "mistral": dict(model_type="mistral", sliding_window=WINDOW, tie=False, num_kv_heads=2),
    # the window in the layers from max_window_layers on (layer 1 of 2)
    "qwen2": dict(model_type="qwen2", tie=False, num_kv_heads=2, config_kwargs=dict(
        use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
    # RoPE over half of each head (Phi-4-mini's 0.75 works the same way)
    "phi3-partial-rotary": dict(model_type="phi3", tie=False, num_kv_heads=2,
                                config_kwargs=dict(partial_rotary_factor=0.5)),
    "phi3-partial-rotary-window": dict(model_type="phi3", tie=False, num_kv_heads=2,
                                       config_kwargs=dict(partial_rotary_factor=0.5,
                                                          sliding_window=WINDOW)),
}
WINDOWED = [name for name in CASES if name != "phi3-partial-rotary"]


@pytest.mark.parametrize("block", [4, 16])
@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers_beyond_the_window(tiny_model_factory, case: str,
                                                     block: int) -> None:
    folder, hf_model = tiny_model_factory(**CASES[case])[:2]
    assert_logits_match(folder, hf_model, prompt_lens=LONG_PROMPTS, steps=STEPS, block=block)


@pytest.mark.parametrize("case", WINDOWED)
def test_the_window_changes_these_logits(tiny_model_factory, case: str) -> None:
    """Full attention in place of the window no longer matches: the sequences above are
    long enough for the window to matter, and transformers' reference does apply it."""
    folder, hf_model = tiny_model_factory(**CASES[case])[:2]
    windows = []

    def unwindow(model: torch.nn.Module) -> None:
        for layer in model.layers:
            windows.append(layer.self_attn.window)
            layer.self_attn.window = None

    with pytest.raises(AssertionError):
        assert_logits_match(folder, hf_model, unwindow, prompt_lens=LONG_PROMPTS, steps=STEPS)
    assert WINDOW in windows


def test_gemma3_layers_window_and_rotate_as_configured(tiny_model_factory) -> None:
    from server.models.loader import load_model, resolve_model_source

    folder = tiny_model_factory(**CASES["gemma3"])[0]
    model = load_model(resolve_model_source(folder), "float32", torch.device("cpu")).model
    assert [layer.self_attn.window for layer in model.layers] == [WINDOW, WINDOW, None]
    assert [layer.local_rope for layer in model.layers] == [True, True, False]
    # local: base 10k unscaled; global: base 1M, positions divided by the linear factor 8
    local = 1.0 / 10_000 ** (torch.arange(0, 32, 2) / 32)
    torch.testing.assert_close(model.rotary_local.inv_freq, local)
    torch.testing.assert_close(model.rotary.inv_freq,
                               1.0 / 1_000_000 ** (torch.arange(0, 32, 2) / 32) / 8)


def hf_greedy(model: torch.nn.Module, prompt: list[int], new_tokens: int) -> list[int]:
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), generation_config=GenerationConfig(
            max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0))
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("case", ["gemma3", "gemma2", "mistral", "phi3-partial-rotary"])
def test_greedy_tokens_match_transformers_with_prefix_caching(tiny_model_factory,
                                                              case: str) -> None:
    """Engine end to end, 4-token blocks: prompts past the window, then one that continues
    the first, so its prefill starts after cached blocks (windowed paged prefill)."""
    folder, hf_model = tiny_model_factory(**CASES[case])[:2]
    llm = LLM(folder, dtype="float32", block_size=4, max_num_seqs=4,
              enable_prefix_caching=True)
    gen = torch.Generator().manual_seed(5)
    vocab = hf_model.config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (30, 9, 45)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    for prompt, got in zip(prompts, outputs):
        assert got == hf_greedy(hf_model, prompt, 20)
    follow_up = prompts[0] + outputs[0] + prompts[1][:5]
    got = llm.generate([follow_up], params)[0].outputs[0].token_ids
    assert llm.engine.stats().prefix_cache_hits >= 40  # 10 of its blocks were cached
    assert got == hf_greedy(hf_model, follow_up, 20)


@pytest.mark.parametrize("case", ["mistral", "gemma3"])
@pytest.mark.parametrize("max_model_len,dropped", [(16, True), (64, False)])
def test_fused_cpu_kernels_serve_windows_and_drop_those_that_mask_nothing(
        tiny_model_factory, max_model_len: int, dropped: bool, case: str) -> None:
    from server.hpu.cpu.kernels import kernels_available

    folder, hf_model = tiny_model_factory(**CASES[case])[:2]
    llm = LLM(folder, dtype="float32", block_size=4, max_num_seqs=2,
              max_model_len=max_model_len, environ={"HPU_SERVE_CPU_KERNELS": "1"})
    if not kernels_available():
        pytest.skip("the fused CPU kernels are not built here")
    attn = llm.engine.runner.model.layers[0].self_attn
    assert attn.ops.name == "fused-cpu"  # the kernels mask windows themselves
    # a window no sequence can outgrow is dropped: no masks to build
    assert attn.window == (None if dropped else WINDOW)
    prompt = list(range(3, 9))
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10,
                                                ignore_eos=True))[0].outputs[0]
    assert out.token_ids == hf_greedy(hf_model, prompt, 10)


@pytest.mark.slow  # a compiled whole-model run (12 s): make test-fast leaves it to make test
def test_gemma3_compiled_graphs_window_like_transformers(tiny_model_factory, tmp_path) -> None:
    """torch.compile per bucket (static shapes; pad rows and pad blocks in every step): the
    window masks replay without recompiling and tokens equal transformers'. Sliding and
    global layers each compile once per bucket (their window is a constant of the graph)."""
    folder, hf_model = tiny_model_factory(**CASES["gemma3"])[:2]
    buckets = tmp_path / "buckets.txt"
    buckets.write_text("# prompt buckets\n(2, [64], 0)\n# decode buckets\n(2, 1, [32])\n")
    llm = LLM(folder, dtype="float32", block_size=4, max_num_seqs=2, max_model_len=64,
              execution_mode="compile", environ={"VLLM_BUCKETING_FROM_FILE": str(buckets)})
    counters = llm.engine.counters
    assert counters.compilations(stage="warmup") == 2 * 2  # 2 buckets x (sliding, global)
    gen = torch.Generator().manual_seed(9)
    vocab = hf_model.config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (37, 6)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outputs):
        assert out.outputs[0].token_ids == hf_greedy(hf_model, prompt, 24)
    assert counters.compilations(stage="serving") == 0


def config_from_json(tmp_path, fields: dict):
    import json

    from transformers import AutoConfig

    from server.models.config import ModelConfig

    (tmp_path / "config.json").write_text(json.dumps(fields))
    return ModelConfig.from_hf(AutoConfig.from_pretrained(tmp_path))


def test_gemma3_config_as_the_hub_ships_it(tmp_path) -> None:
    """google/gemma-3-1b-it's config.json style (older transformers' fields): a pattern
    instead of layer_types, rope_local_base_freq beside rope_theta and rope_scaling."""
    cfg = config_from_json(tmp_path, dict(
        architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", vocab_size=262144,
        hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=512,
        sliding_window_pattern=6, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
        rope_scaling=dict(rope_type="linear", factor=8.0), max_position_embeddings=32768,
        rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh"))
    assert [i for i in range(26) if cfg.layer_window(i) is None] == [5, 11, 17, 23]
    assert cfg.layer_window(0) == 512 and cfg.min_window == 512
    assert (cfg.rope_theta, cfg.rope_scaling["rope_type"], cfg.rope_scaling["factor"]) == \
        (1_000_000.0, "linear", 8.0)
    assert (cfg.local_rope_theta, cfg.local_rope_scaling) == (10_000.0, None)
    assert cfg.qk_norm and cfg.sandwich_norms and cfg.attn_softcap is None
    assert cfg.attention_multiplier == 256**-0.5


@pytest.mark.parametrize("fields,windows", [
    (dict(use_sliding_window=False, sliding_window=32), [None, None, None]),
    (dict(use_sliding_window=True, sliding_window=32, max_window_layers=1), [None, 32, 32]),
])
def test_qwen2_windows_follow_use_sliding_window(tmp_path, fields, windows) -> None:
    cfg = config_from_json(tmp_path, dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=100, hidden_size=64,
        intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, **fields))
    assert [cfg.layer_window(i) for i in range(3)] == windows


def test_partial_rotary_sizes_rope_over_the_rotated_dims(tmp_path) -> None:
    cfg = config_from_json(tmp_path, dict(
        architectures=["Phi3ForCausalLM"], model_type="phi3", vocab_size=100, hidden_size=64,
        intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        partial_rotary_factor=0.75))
    assert (cfg.head_dim, cfg.rotary_dim) == (16, 12)


def test_gemma3_bfloat16_prefill_rounds_like_transformers(tiny_model_factory) -> None:
    """In bfloat16 the norms scale by 1 + w in float32 and round once, w held in bfloat16,
    as transformers does (1 + w rounded to bfloat16 put these logits 0.11 apart)."""
    from server.engine.core.sequence import Sequence
    from server.engine.worker.input_builder import InputBuilder
    from server.engine.worker.model_runner import ModelForward
    from server.hpu.kv_cache import allocate_kv_cache
    from server.models.loader import load_model, resolve_model_source

    folder, hf_model = tiny_model_factory(**CASES["gemma3"])[:2]
    prompt = torch.randint(3, 300, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    loaded = load_model(resolve_model_source(folder), "bfloat16", torch.device("cpu"))
    cfg = loaded.config
    kv = allocate_kv_cache(cfg.num_layers, 16, 4, cfg.num_kv_heads, cfg.head_dim,
                           torch.bfloat16, torch.device("cpu"))
    seq = Sequence(0, "0", 0, prompt, SamplingParams(), 0.0)
    seq.block_table = list(range(8))
    with torch.inference_mode():
        inputs = InputBuilder(4, 16, torch.device("cpu"), torch.bfloat16, 4096).prefill([seq])
        ours = ModelForward(loaded.model, kv)(inputs)[0]
    reference = type(hf_model).from_pretrained(folder, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        want = reference(torch.tensor([prompt])).logits[0, -1].float()
    assert (ours - want).abs().max() < 0.02
