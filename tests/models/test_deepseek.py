"""DeepSeek-V3 / V2 (multi-head latent attention, grouped biased top-k routing, shared
experts, YaRN with mscale) against transformers' own implementation on tiny random models:
logits at every prefill and decode step, greedy tokens through the engine (eager, with a
cached prefix, compiled with 0 serving compilations, tensor parallel), and the latent KV
cache's size."""

from __future__ import annotations

import logging

import pytest
import torch
from test_llama import BLOCK, assert_logits_match
from test_sliding_window import hf_greedy

from server import LLM, SamplingParams
from server.models.loader import load_model, load_model_config, resolve_model_source
from server.models.mla import MLAttention

V3 = dict(model_type="deepseek_v3", tie=False)
V2 = dict(model_type="deepseek_v2", tie=False)
# several 8-token blocks each, prefilled as one padded batch, then decoded past more blocks
PROMPT_LENS = (5, 29, 17, 40)


@pytest.mark.parametrize("case", [V3, V2], ids=["v3", "v2"])
def test_logits_match_transformers(tiny_model_factory, case: dict) -> None:
    folder, hf_model = tiny_model_factory(**case)[:2]
    assert_logits_match(folder, hf_model, prompt_lens=PROMPT_LENS, steps=10)


def test_expanded_decode_matches_too(tiny_model_factory) -> None:
    """The reference decode (every cached latent expanded to per-head keys and values)
    gives the same logits as the absorbed one that serves."""
    folder, hf_model = tiny_model_factory(**V3)[:2]
    layers: list[MLAttention] = []

    def expand(model: torch.nn.Module) -> None:
        for layer in model.layers:
            layer.self_attn.absorbed_decode = False
            layers.append(layer.self_attn)

    assert_logits_match(folder, hf_model, expand, prompt_lens=PROMPT_LENS, steps=6)
    assert len(layers) == 3 and all(isinstance(a, MLAttention) for a in layers)


@pytest.mark.parametrize("what", ["interleave", "bias", "mscale"])
def test_each_departure_changes_these_logits(tiny_model_factory, monkeypatch, what: str
                                             ) -> None:
    """The tiny model exercises each DeepSeek departure: leaving one out no longer
    matches transformers."""
    import dataclasses

    from server.models import config as config_module
    from server.models import weight_load

    folder, hf_model = tiny_model_factory(**V3)[:2]
    if what == "interleave":  # the checkpoint's RoPE rows used in their interleaved order
        monkeypatch.setattr(weight_load, "deinterleave_rope_rows", lambda n, t, m: t)
        inspect = None
    elif what == "bias":
        def inspect(model: torch.nn.Module) -> None:
            for layer in model.layers[1:]:
                layer.mlp.e_score_correction_bias.data.zero_()
    else:  # the softmax scale without YaRN's mscale(all dims) squared
        original = config_module.deepseek_settings

        def plain(hf, v3, rope_scaling):  # noqa: ANN001, ANN202
            fields = original(hf, v3, rope_scaling)
            mla = fields["mla"]
            fields["mla"] = dataclasses.replace(mla, softmax_scale=mla.qk_head_dim ** -0.5)
            return fields

        monkeypatch.setattr(config_module, "deepseek_settings", plain)
        inspect = None
    with pytest.raises(AssertionError):
        assert_logits_match(folder, hf_model, inspect, prompt_lens=PROMPT_LENS, steps=2)


def test_config_reads_the_deepseek_fields(tiny_model_factory) -> None:
    from server.models.moe_routing import GroupScore, Scoring

    cfg = load_model_config(resolve_model_source(tiny_model_factory(**V3)[0]))
    assert cfg.mla is not None and cfg.mla.cache_dim == 32 + 8
    assert cfg.mla.q_lora_rank == 48 and cfg.mla.rope_interleaved
    assert cfg.head_dim == 8  # the rotary tables span the RoPE dims only
    assert cfg.moe_layers == (1, 2) and cfg.num_shared_experts == 1  # first_k_dense_replace
    router = cfg.moe_router
    assert (router.scoring, router.groups, router.topk_groups, router.group_score,
            router.scaling, router.score_bias) == (Scoring.SIGMOID, 4, 2, GroupScore.TOP2_SUM,
                                                   2.5, True)
    assert cfg.mtp_layers == 1
    v2 = load_model_config(resolve_model_source(tiny_model_factory(**V2)[0]))
    assert v2.moe_router.scoring is Scoring.SOFTMAX and v2.moe_router.group_score is \
        GroupScore.MAX and not v2.moe_router.score_bias and v2.mla.q_lora_rank is None


def test_router_matches_transformers() -> None:
    """Grouped top-k with the correction bias, renormalised and scaled, on random logits
    (sets of experts compared: transformers does not sort them)."""
    import transformers
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    from server.models.moe_routing import GroupScore, RouterSettings, Scoring, route

    config = transformers.DeepseekV3Config(hidden_size=16, n_routed_experts=16, n_group=4,
                                           topk_group=2, num_experts_per_tok=3,
                                           routed_scaling_factor=2.5, norm_topk_prob=True)
    gen = torch.Generator().manual_seed(0)
    ref = DeepseekV3TopkRouter(config)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(16, 16, generator=gen))
        ref.e_score_correction_bias.copy_(torch.rand(16, generator=gen) * 0.3)
    x = torch.randn(50, 16, generator=gen)
    logits, ref_weights, ref_ids = ref(x)
    settings = RouterSettings(Scoring.SIGMOID, 4, 2, GroupScore.TOP2_SUM, 2.5, True)
    weights, ids = route(logits, 3, True, settings, ref.e_score_correction_bias)
    order, ref_order = ids.argsort(dim=-1), ref_ids.argsort(dim=-1)
    assert torch.equal(ids.gather(1, order), ref_ids.gather(1, ref_order))
    torch.testing.assert_close(weights.gather(1, order), ref_weights.gather(1, ref_order))


def test_kv_bytes_per_token_are_the_latent(tiny_model_factory, caplog) -> None:
    """layers x (kv_lora_rank + qk_rope_head_dim) x dtype size per token, logged at start-up
    and what the allocated cache holds per block."""
    folder = tiny_model_factory(**V3)[0]
    runner_log = logging.getLogger("server.engine.worker.model_runner")
    runner_log.addHandler(caplog.handler)  # LLM() stops server.* propagating to the root
    caplog.set_level(logging.INFO, logger=runner_log.name)
    try:
        llm = LLM(folder, dtype="float32", block_size=BLOCK, max_num_seqs=4,
                  max_model_len=128)
    finally:
        runner_log.removeHandler(caplog.handler)
    runner = llm.engine.runner
    per_token = 3 * (32 + 8) * 4
    assert runner.kv_layout.bytes_per_token(torch.float32) == per_token
    assert runner.kv_cache_bytes == (runner.num_blocks + 1) * BLOCK * per_token
    assert f"KV cache layout: {per_token} bytes per token (3 layers x 40 x 4 bytes" \
        in caplog.text
    assert "Attention: multi-head latent (MLA) on torch ops" in caplog.text
    # a Llama of the same width would cache 2 x heads x head_dim per layer instead
    assert runner.kv_caches[0][0] is runner.kv_caches[0][1]
    assert tuple(runner.kv_caches[0][0].shape) == (runner.num_blocks + 1, 1, BLOCK, 40)


@pytest.mark.parametrize("case", [V3, V2], ids=["v3", "v2"])
def test_greedy_tokens_match_transformers_with_prefix_caching(tiny_model_factory,
                                                              case: dict) -> None:
    """Engine end to end, 4-token blocks: long prompts, then one continuing the first, so
    its prefill starts after cached blocks (the absorbed paged-prefill path)."""
    folder, hf_model = tiny_model_factory(**case)[:2]
    llm = LLM(folder, dtype="float32", block_size=4, max_num_seqs=4,
              enable_prefix_caching=True)
    gen = torch.Generator().manual_seed(5)
    vocab = hf_model.config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (30, 9, 45)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    for prompt, got in zip(prompts, outputs):
        assert got == hf_greedy(hf_model, prompt, 16)
    follow_up = prompts[0] + outputs[0] + prompts[1][:5]
    got = llm.generate([follow_up], params)[0].outputs[0].token_ids
    assert llm.engine.stats().prefix_cache_hits >= 40
    assert got == hf_greedy(hf_model, follow_up, 16)


def test_mtp_layer_tensors_are_skipped_with_a_log_line(tiny_model_factory, tmp_path,
                                                      caplog) -> None:
    """A checkpoint with DeepSeek-V3's MTP layer (stored as layer num_hidden_layers) loads;
    its tensors are skipped and the log says so. A tensor of a layer past it still fails."""
    import shutil

    from safetensors.torch import save_file

    from server.models.errors import ModelFileError

    folder = tiny_model_factory(**V3)[0]
    shutil.copytree(folder, tmp_path / "m")
    mtp = {"model.layers.3.eh_proj.weight": torch.zeros(64, 128),
           "model.layers.3.enorm.weight": torch.ones(64),
           "model.layers.3.self_attn.kv_b_proj.weight": torch.zeros(4 * 28, 32)}
    save_file(mtp, tmp_path / "m" / "mtp.safetensors")
    caplog.set_level(logging.INFO, logger="server.models.weight_load")
    load_model(resolve_model_source(str(tmp_path / "m")), "float32", torch.device("cpu"))
    assert "Skipped the 3 tensors of the 1 multi-token-prediction layer(s) (layers 3-3" \
        in caplog.text
    save_file({"model.layers.4.enorm.weight": torch.ones(64)},
              tmp_path / "m" / "mtp.safetensors")
    with pytest.raises(ModelFileError, match="has no place in the model"):
        load_model(resolve_model_source(str(tmp_path / "m")), "float32", torch.device("cpu"))


def test_lora_is_refused(tiny_model_factory) -> None:
    with pytest.raises(ValueError, match="multi-head latent attention"):
        LLM(tiny_model_factory(**V3)[0], dtype="float32", enable_lora=True)


@pytest.mark.slow
def test_compiled_buckets_serve_with_no_compilation(tiny_model_factory, tmp_path) -> None:
    """Compile mode: every planned bucket warmed before serving, then greedy tokens equal
    to transformers' with 0 compilations and 0 bucket misses while serving."""
    folder, hf_model = tiny_model_factory(**V3)[:2]
    buckets = tmp_path / "b.txt"
    buckets.write_text("([4], 48, [0])\n([4], 1, [16, 32])\n")  # 3 graphs: CPU compiles are slow
    llm = LLM(folder, dtype="float32", block_size=8, max_num_seqs=4, max_model_len=64,
              execution_mode="compile", enable_prefix_caching=False,
              environ={"VLLM_BUCKETING_FROM_FILE": str(buckets)})
    counters = llm.engine.counters
    assert counters.compilations(stage="warmup") > 0
    gen = torch.Generator().manual_seed(7)
    vocab = hf_model.config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (40, 11, 23)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outputs):
        assert out.outputs[0].token_ids == hf_greedy(hf_model, prompt, 12)
    assert counters.compilations(stage="serving") == 0
    assert sum(counters._misses.labels(counters.model_name, p)._value.get()
               for p in ("prefill", "decode")) == 0


@pytest.mark.slow
def test_tensor_parallel_2_matches_1(tiny_model_factory) -> None:
    """TP 2: each rank holds half the heads (q, kv_b, o split by head) and the whole
    latent (replicated: every rank caches it), half of every expert and of the shared
    expert; same greedy tokens and logits as one rank."""
    from tests.engine.executor.test_tensor_parallel import PROMPTS, SMALL, assert_same, generate

    folder = tiny_model_factory(**V3)[0]
    reference = generate(folder, 1, PROMPTS, 16, **SMALL)
    parallel = generate(folder, 2, PROMPTS, 16, **SMALL)
    assert_same(reference, parallel)


def test_tensor_parallel_shards_split_heads_and_replicate_the_latent(tiny_model_factory
                                                                    ) -> None:
    from server.hpu.distributed import ParallelContext

    source = resolve_model_source(tiny_model_factory(**V3)[0])
    whole = load_model(source, "float32", torch.device("cpu")).model
    ranks = [load_model(source, "float32", torch.device("cpu"), ParallelContext(r, 2))
             for r in range(2)]
    attn = [r.model.layers[1].self_attn for r in ranks]
    assert [a.num_heads for a in attn] == [2, 2]
    full = whole.layers[1].self_attn
    # kv_b_proj: rank r holds heads 2r, 2r + 1 (28 rows each: 16 key + 12 value)
    torch.testing.assert_close(torch.cat([a.kv_b_proj.weight for a in attn]),
                               full.kv_b_proj.weight)
    torch.testing.assert_close(torch.cat([a.o_proj.weight for a in attn], dim=1),
                               full.o_proj.weight)
    for a in attn:  # the latent's projection is every rank's
        torch.testing.assert_close(a.kv_a_proj_with_mqa.weight, full.kv_a_proj_with_mqa.weight)
    shared = [r.model.layers[1].mlp.shared_experts for r in ranks]
    assert [s.down_proj.weight.shape[1] for s in shared] == [16, 16]
    assert all(r.config.kv_layout == whole.config.kv_layout for r in ranks)


@pytest.mark.slow
def test_speculative_verify_steps_match_transformers(tiny_model_factory) -> None:
    """n-gram drafts on repetitive prompts: the verify steps (several queries per row over
    the latent cache) keep transformers' greedy tokens, and drafts were accepted."""
    folder, hf_model = tiny_model_factory(**V3)[:2]
    llm = LLM(folder, dtype="float32", block_size=8, max_num_seqs=4, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3})
    prompts = [list(range(5, 25)) * 3, [7, 8, 9] * 10]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        assert out.outputs[0].token_ids == hf_greedy(hf_model, prompt, 24)
    assert llm.engine.stats().spec_num_drafts > 0


def test_router_bias_stays_float32_in_bfloat16(tiny_model_factory) -> None:
    from safetensors import safe_open

    folder = tiny_model_factory(**V3)[0]
    model = load_model(resolve_model_source(folder), "bfloat16", torch.device("cpu")).model
    block = model.layers[1].mlp
    assert block.gate.weight.dtype == torch.bfloat16
    with safe_open(f"{folder}/model.safetensors", "pt") as f:
        want = f.get_tensor("model.layers.1.mlp.gate.e_score_correction_bias")
    assert block.e_score_correction_bias.dtype == torch.float32
    assert torch.equal(block.e_score_correction_bias.data, want.float())
