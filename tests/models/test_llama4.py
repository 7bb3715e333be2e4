"""Llama 4 text (Llama4ForCausalLM, and the language model of Llama4ForConditionalGeneration)
against transformers on the same tiny random weights: logits at every prefill and decode step
and greedy tokens through the engine, on prompts spanning several KV blocks and 8-token
attention chunks, decoding past chunk boundaries; each departure (chunks, NoPE temperature,
L2 q/k norms, interleaved RoPE, input-scaled sigmoid experts) shown to matter."""

from __future__ import annotations

import logging

import pytest
import torch
from test_llama import assert_logits_match
from test_sliding_window import hf_greedy

from server import LLM, SamplingParams
from tests.recording_sampler import RecordingSampler

CHUNK = 8
# prefilled together as one padded batch, then decoded 14 steps: up to 55 tokens, 7 chunks
LONG_PROMPTS = (5, 23, 41, 12)
STEPS = 14
KINDS = ["llama4_text", "llama4"]  # Llama4ForCausalLM, Llama4ForConditionalGeneration


def tiny(factory, kind: str = "llama4_text") -> tuple:
    """(folder, reference, tokenizer); the conditional-generation model's reference is its
    language model (what its forward runs for text alone), on the saved weights."""
    folder, hf_model, tokenizer = factory(model_type=kind, tie=False, num_kv_heads=2)
    if kind == "llama4":
        hf_model = hf_model.language_model
    return folder, hf_model, tokenizer


@pytest.mark.parametrize("block", [4, 16])
@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_transformers_across_chunks(tiny_model_factory, kind: str,
                                                 block: int) -> None:
    folder, hf_model = tiny(tiny_model_factory, kind)[:2]
    assert_logits_match(folder, hf_model, prompt_lens=LONG_PROMPTS, steps=STEPS, block=block)


def _unchunk(model: torch.nn.Module) -> None:
    for layer in model.layers:
        layer.self_attn.chunk = None


def _untune(model: torch.nn.Module) -> None:
    for layer in model.layers:
        layer.self_attn.tuned = False


def _unnorm(model: torch.nn.Module) -> None:
    for layer in model.layers:
        layer.self_attn.l2_norm = False


def _output_scaled_experts(model: torch.nn.Module) -> None:
    """Mixtral's convention (weights scale the experts' outputs) in place of Llama 4's."""
    from server.models.llama4 import Llama4MoeBlock
    from server.models.moe import dense_experts

    def forward(self: Llama4MoeBlock, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, ids = self.route(flat)
        out = dense_experts(flat, self.w_gate_up, self.w_down, weights, ids, self.ops)
        return (self.shared_expert(flat) + out).view(x.shape)

    for layer in model.layers:
        if isinstance(layer.mlp, Llama4MoeBlock):
            layer.mlp.forward = forward.__get__(layer.mlp)


@pytest.mark.parametrize("breaks", [_unchunk, _untune, _unnorm, _output_scaled_experts],
                         ids=["no-chunks", "no-temperature", "no-qk-norm", "output-scaling"])
def test_each_departure_changes_these_logits(tiny_model_factory, breaks) -> None:
    """Without any one of them the logits no longer match: the sequences are long enough
    for chunks and temperature steps to matter, and transformers does apply each."""
    folder, hf_model = tiny(tiny_model_factory)[:2]
    with pytest.raises(AssertionError):
        assert_logits_match(folder, hf_model, breaks, prompt_lens=LONG_PROMPTS, steps=STEPS,
                            block=4)


@pytest.mark.parametrize("block", [1, 4])
def test_grouped_experts_match_transformers(tiny_model_factory, monkeypatch, block) -> None:
    """The grouped expert computation (the tiny shapes pick the dense one) with Llama 4's
    input-scaled experts: one gathered expert per token (1), or sorted into blocks (4)."""
    from server.models import llama4

    shapes = []

    def plan(tokens: int, top_k: int, num_experts: int) -> int:
        shapes.append(tokens)
        return block

    monkeypatch.setattr(llama4, "expert_plan", plan)
    folder, hf_model = tiny(tiny_model_factory)[:2]
    assert_logits_match(folder, hf_model, prompt_lens=LONG_PROMPTS, steps=4, block=4)
    assert 4 * 41 in shapes and 4 in shapes  # prefill and decode both went the grouped way


def test_layers_as_configured_and_vision_tower_ignored(tiny_model_factory, caplog) -> None:
    from server.models.llama import MLP
    from server.models.llama4 import Llama4MoeBlock
    from server.models.loader import load_model, resolve_model_source

    folder = tiny(tiny_model_factory, "llama4")[0]
    with caplog.at_level(logging.INFO, logger="server.models.loader"):
        model = load_model(resolve_model_source(folder), "float32", torch.device("cpu")).model
    attn = [layer.self_attn for layer in model.layers]
    assert [a.chunk for a in attn] == [CHUNK, CHUNK, CHUNK, None]
    assert [a.rotates for a in attn] == [True, True, True, False]
    assert [a.l2_norm for a in attn] == [True, True, True, False]
    assert [a.tuned for a in attn] == [False, False, False, True]
    assert [type(layer.mlp) for layer in model.layers] == [MLP, Llama4MoeBlock] * 2
    assert model.layers[0].mlp.intermediate_size == 96  # intermediate_size_mlp
    assert model.layers[1].mlp.shared_expert.intermediate_size == 32
    assert "ignored" in caplog.text and "vision_model" in caplog.text
    model.serve_context(CHUNK)  # a chunk no sequence can outgrow masks nothing
    assert [a.chunk for a in attn] == [None] * 4


@pytest.mark.parametrize("kernels", [False, True], ids=["torch-ops", "fused-cpu"])
def test_greedy_tokens_match_transformers_with_prefix_caching(tiny_model_factory,
                                                              kernels: bool) -> None:
    """Engine end to end, 4-token blocks, prompts over several chunks, then one continuing
    the first so that its prefill starts after cached blocks (chunked paged prefill); on
    the PyTorch ops and on the fused CPU kernels (which mask chunks themselves)."""
    from server.hpu.cpu.kernels import kernels_available

    folder, hf_model = tiny(tiny_model_factory)[:2]
    llm = LLM(folder, dtype="float32", block_size=4, max_num_seqs=4,
              enable_prefix_caching=True,
              environ={"HPU_SERVE_CPU_KERNELS": "1" if kernels else "0"})
    attn = llm.engine.runner.model.layers[0].self_attn
    if kernels:
        if not kernels_available():
            pytest.skip("the fused CPU kernels are not built here")
        assert attn.ops.name == "fused-cpu"
    assert attn.chunk == CHUNK
    gen = torch.Generator().manual_seed(5)
    vocab = hf_model.config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (30, 9, 45)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    for prompt, got in zip(prompts, outputs):
        assert got == hf_greedy(hf_model, prompt, 20)
    follow_up = prompts[0] + outputs[0] + prompts[1][:5]
    got = llm.generate([follow_up], params)[0].outputs[0].token_ids
    assert llm.engine.stats().prefix_cache_hits >= 40
    assert got == hf_greedy(hf_model, follow_up, 20)



def assert_engine_matches_transformers(llm: LLM, hf_model: torch.nn.Module,
                                       prompt_lens: tuple[int, ...], new_tokens: int) -> None:
    """One prompt at a time: greedy tokens equal transformers', and the logits of every
    step (the prefill's last token, then each decode) equal its forward over the whole
    sequence at that position."""
    recorder = RecordingSampler(llm.engine.runner.sampler)
    llm.engine.runner.sampler = recorder
    gen = torch.Generator().manual_seed(7)
    vocab = hf_model.config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for n in prompt_lens:
        prompt = torch.randint(3, vocab, (n,), generator=gen).tolist()
        recorder.logits.clear()
        got = llm.generate([prompt], params)[0].outputs[0].token_ids
        assert got == hf_greedy(hf_model, prompt, new_tokens)
        with torch.no_grad():
            ref = hf_model(torch.tensor([prompt + got])).logits[0].float()
        assert len(recorder.logits) == new_tokens
        for step, logits in enumerate(recorder.logits):
            torch.testing.assert_close(logits[0], ref[n - 1 + step], atol=2e-4, rtol=1e-4)


@pytest.mark.slow  # a compiled whole-model run
def test_compiled_graphs_match_transformers_with_no_serving_compilation(tiny_model_factory,
                                                                        tmp_path) -> None:
    """torch.compile per bucket (static shapes, pad rows and pad blocks in every step):
    the chunk masks, NoPE temperatures and routed experts replay without recompiling."""
    folder, hf_model = tiny(tiny_model_factory)[:2]
    buckets = tmp_path / "buckets.txt"
    buckets.write_text("# prompt buckets\n(1, [64], 0)\n# decode buckets\n(1, 1, [16])\n")
    llm = LLM(folder, dtype="float32", block_size=4, max_num_seqs=1, max_model_len=64,
              execution_mode="compile", environ={"VLLM_BUCKETING_FROM_FILE": str(buckets)})
    counters = llm.engine.counters
    assert counters.compilations(stage="warmup") > 0
    assert_engine_matches_transformers(llm, hf_model, (37, 6), 20)
    assert counters.compilations(stage="serving") == 0


@pytest.mark.slow  # spawns a second rank
def test_tensor_parallel_2_matches_transformers(tiny_model_factory) -> None:
    """Two ranks (gloo): each holds half the heads, half of every expert's and the shared
    expert's width and half the dense MLP; interleaved-RoPE rows reordered per rank."""
    folder, hf_model = tiny(tiny_model_factory, "llama4")[:2]
    llm = LLM(folder, dtype="float32", block_size=4, max_num_seqs=2, max_model_len=128,
              tensor_parallel_size=2)
    try:
        assert llm.engine.runner.model.config.num_heads == 2  # this rank's half
        assert_engine_matches_transformers(llm, hf_model, (37, 6), 20)
    finally:
        llm.shutdown()


@pytest.mark.slow  # a server process
def test_conditional_generation_checkpoint_served_over_http(tiny_model_factory) -> None:
    """The Llama4ForConditionalGeneration folder served as a text model through the real
    server and the OpenAI SDK: a greedy completion (past two chunk boundaries) equal to
    transformers', streamed and not."""
    import openai
    from server_process import MODEL_NAME, TINY_FLAGS, start_server

    folder, hf_model, hf_tokenizer = tiny(tiny_model_factory, "llama4")
    prompt = torch.randint(3, hf_model.config.vocab_size, (11,),
                           generator=torch.Generator().manual_seed(3)).tolist()
    expected = hf_tokenizer.decode(hf_greedy(hf_model, prompt, 12))
    server = start_server(folder, *TINY_FLAGS)
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
        fields = dict(model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0,
                      extra_body={"ignore_eos": True})
        done = client.completions.create(**fields)
        streamed = "".join(chunk.choices[0].text for chunk in
                           client.completions.create(stream=True, **fields) if chunk.choices)
    finally:
        server.stop()
    assert done.choices[0].text == expected
    assert done.usage.completion_tokens == 12
    assert streamed == expected


def llama4_as_llama_cpp_runs_it() -> torch.nn.Module:
    """A tiny Llama 4 with the values llama.cpp fixes instead of reading them from a GGUF
    file (8192-token chunks in three layers of four, the fourth NoPE, temperature floor 8192
    and scale 0.1, q/k norms): transformers' defaults, the released models' values."""
    import transformers
    from test_gguf_families import scaled

    torch.manual_seed(0)
    cfg = transformers.Llama4TextConfig(
        vocab_size=320, hidden_size=64, intermediate_size=32, intermediate_size_mlp=96,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2,
        max_position_embeddings=512, tie_word_embeddings=False)
    return scaled(transformers.Llama4ForCausalLM(cfg))


def write_llama4_gguf(path, hf_model: torch.nn.Module) -> None:  # noqa: ANN001 - a Path
    """As llama.cpp's converter writes Llama 4: feed_forward_length the dense MLPs' width,
    expert_feed_forward_length the experts'; q/k rows as they are (no permutation); the
    experts' gate_up split into ffn_gate_exps / ffn_up_exps [E, I, H], down as [E, H, I];
    the router ffn_gate_inp, the shared expert ffn_*_shexp."""
    import gguf
    import numpy as np

    cfg = hf_model.config
    writer = gguf.GGUFWriter(str(path), "llama4")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size_mlp)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_expert_count(cfg.num_local_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    writer.add_interleave_moe_layer_step(cfg.interleave_moe_layer_step)
    writer.add_expert_feed_forward_length(cfg.intermediate_size)
    block = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "feed_forward.gate_proj": "ffn_gate", "feed_forward.up_proj": "ffn_up",
             "feed_forward.down_proj": "ffn_down", "feed_forward.router": "ffn_gate_inp",
             "feed_forward.shared_expert.gate_proj": "ffn_gate_shexp",
             "feed_forward.shared_expert.up_proj": "ffn_up_shexp",
             "feed_forward.shared_expert.down_proj": "ffn_down_shexp"}
    top = {"model.embed_tokens.weight": "token_embd.weight",
           "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
    for name, tensor in hf_model.state_dict().items():
        array = tensor.float().numpy()
        if name in top:
            writer.add_tensor(top[name], array)
            continue
        _, _, layer, rest = name.split(".", 3)
        if rest == "feed_forward.experts.gate_up_proj":  # [E, H, 2I]
            gate, up = np.split(array.swapaxes(1, 2), 2, axis=1)
            writer.add_tensor(f"blk.{layer}.ffn_gate_exps.weight", np.ascontiguousarray(gate))
            writer.add_tensor(f"blk.{layer}.ffn_up_exps.weight", np.ascontiguousarray(up))
        elif rest == "feed_forward.experts.down_proj":  # [E, I, H]
            writer.add_tensor(f"blk.{layer}.ffn_down_exps.weight",
                              np.ascontiguousarray(array.swapaxes(1, 2)))
        else:
            module, kind = rest.rsplit(".", 1)
            writer.add_tensor(f"blk.{layer}.{block[module]}.{kind}", array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_as_llama_cpp_writes_it(tmp_path) -> None:
    """A GGUF file of llama.cpp's "llama4" layout gives transformers' logits and greedy
    tokens; the header's sizes and llama.cpp's fixed chunk / NoPE / temperature values are
    read as such (the chunk, 8192 tokens, is not crossed here)."""
    from test_gguf_families import assert_matches

    from server.models.loader import load_model, resolve_model_source

    hf_model = llama4_as_llama_cpp_runs_it()
    folder = tmp_path / "llama4"
    folder.mkdir()
    write_llama4_gguf(folder / "tiny-llama4.gguf", hf_model)
    cfg = load_model(resolve_model_source(str(folder)), "float32", torch.device("cpu")).config
    assert (cfg.intermediate_size, cfg.moe_intermediate_size, cfg.moe_layers) == (96, 32, (1, 3))
    assert (cfg.attention_chunk_size, cfg.chunked_layers, cfg.nope_layers) == (8192, (0, 1, 2),
                                                                                (3,))
    assert cfg.attn_temperature == (8192.0, 0.1) and cfg.qk_l2_norm and not cfg.norm_topk_prob
    assert_matches(str(folder), hf_model)


@pytest.mark.slow  # two engines
@pytest.mark.parametrize("kernels", [False, True], ids=["torch-ops", "fused-cpu"])
def test_speculative_verify_across_chunks_keeps_greedy_tokens(tiny_model_factory,
                                                              kernels: bool) -> None:
    """ngram speculation on repetitive prompts: each verify step's queries (the last token
    and up to 3 drafts) straddle 8-token chunk boundaries; the tokens stay transformers'."""
    folder, hf_model = tiny(tiny_model_factory)[:2]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3}
    llm = LLM(folder, dtype="float32", block_size=4, max_num_seqs=4, speculative_config=spec,
              environ={"HPU_SERVE_CPU_KERNELS": "1" if kernels else "0"})
    prompts = [list(range(5, 15)) * 3, [7, 8, 9] * 6, list(range(40, 53)) * 2]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == [hf_greedy(hf_model, p, 24) for p in prompts]
    assert llm.engine.stats().spec_num_drafts > 0


def test_lora_adapter_matches_peft(tiny_model_factory, tmp_path) -> None:
    """A PEFT LoRA on the attention (q/k outputs reordered like the base rows) and on the
    dense layers' MLPs gives the tokens of PEFT's merged model; one on a shared expert is
    refused with a clear error."""
    import copy

    from peft import LoraConfig, PeftModel, get_peft_model

    from server import LoRARequest
    from server.models.loader import load_model_config, resolve_model_source
    from server.models.lora.peft import AdapterError, load_peft_adapter

    folder, hf_model = tiny(tiny_model_factory)[:2]

    def adapter(targets: str, path) -> str:  # noqa: ANN001 - a Path
        torch.manual_seed(1)
        peft_model = get_peft_model(copy.deepcopy(hf_model), LoraConfig(
            r=8, lora_alpha=16, target_modules=targets, lora_dropout=0.0))
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, 0.5)
        peft_model.save_pretrained(path)
        return str(path)

    dense = adapter(r".*self_attn\.(q|k|v|o)_proj|.*layers\.(0|2)\.feed_forward\.\w+_proj",
                    tmp_path / "dense")
    reference = PeftModel.from_pretrained(copy.deepcopy(hf_model), dense).merge_and_unload()
    llm = LLM(folder, dtype="float32", block_size=4, max_num_seqs=2, enable_lora=True,
              max_loras=1, max_lora_rank=8)
    prompt = torch.randint(3, hf_model.config.vocab_size, (21,),
                           generator=torch.Generator().manual_seed(4)).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    got = llm.generate([prompt], params, lora_request=LoRARequest("a", 1, dense))
    assert got[0].outputs[0].token_ids == hf_greedy(reference.eval(), prompt, 12)
    assert got[0].outputs[0].token_ids != hf_greedy(hf_model, prompt, 12)
    shared = adapter(r".*shared_expert\.gate_proj", tmp_path / "shared")
    cfg = load_model_config(resolve_model_source(folder))
    with pytest.raises(AdapterError, match="shared_expert"):
        load_peft_adapter(shared, cfg, 8, torch.float32)
