"""gpt-oss (``GptOssForCausalLM``) against transformers' own implementation on a tiny random
model it builds: attention sinks, a sliding window on every other layer (8 tokens here, so
that 4-token blocks, prompts several windows long and decode past them all cross it), q/k/v/o
biases, the biased router, the experts' biases and clamped SwiGLU, YaRN. Logits at every
prefill and decode step, greedy tokens through the engine in eager mode (PyTorch ops and the
fused CPU kernels), in compile mode with no serving compilation, and at tensor-parallel
size 2; MXFP4 experts against transformers' dequantization."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_llama import assert_logits_match
from test_sliding_window import hf_greedy

from server import LLM, SamplingParams

WINDOW = 8
CASE = dict(model_type="gpt_oss", tie=False, num_kv_heads=2, sliding_window=WINDOW)
LONG_PROMPTS = (5, 23, 41, 12)  # up to 41 + 14 tokens: about 7 windows
STEPS = 14


@pytest.fixture(scope="module")
def gpt_oss(tiny_model_factory) -> tuple:
    return tiny_model_factory(**CASE)


@pytest.mark.parametrize("block", [4, 16])
def test_logits_match_transformers(gpt_oss, block: int) -> None:
    folder, hf_model = gpt_oss[:2]
    assert_logits_match(folder, hf_model, prompt_lens=LONG_PROMPTS, steps=STEPS, block=block)


def test_config_and_layers(gpt_oss) -> None:
    from server.models.loader import load_model, resolve_model_source

    loaded = load_model(resolve_model_source(gpt_oss[0]), "float32", torch.device("cpu"))
    cfg, model = loaded.config, loaded.model
    assert (cfg.attn_sinks, cfg.moe_bias, cfg.swiglu_limit, cfg.norm_topk_prob) == \
        (True, True, 7.0, True)
    assert [layer.self_attn.window for layer in model.layers] == [WINDOW, None]
    assert cfg.moe_layers == (0, 1) and cfg.qkv_bias and cfg.o_bias


def _break(part: str):
    def inspect(model: torch.nn.Module) -> None:
        for layer in model.layers:
            if part == "sinks":
                layer.self_attn.sinks = None
            elif part == "window":
                layer.self_attn.window = None
            elif part == "clamp":
                layer.mlp.act_fn = None  # plain SwiGLU
            elif part == "expert-bias":
                layer.mlp.b_down = None
    return inspect


@pytest.mark.parametrize("part", ["sinks", "window", "clamp", "expert-bias"])
def test_each_departure_changes_these_logits(gpt_oss, part: str) -> None:
    """Without any one of them the logits no longer match: the reference applies each and
    these inputs exercise each."""
    folder, hf_model = gpt_oss[:2]
    with pytest.raises(AssertionError):
        assert_logits_match(folder, hf_model, _break(part), prompt_lens=LONG_PROMPTS,
                            steps=STEPS, block=4)


def _prompts(hf_model, lens=(30, 9, 45)) -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(3, hf_model.config.vocab_size, (n,), generator=gen).tolist()
            for n in lens]


def test_greedy_tokens_match_transformers_with_prefix_caching(gpt_oss) -> None:
    """The engine end to end (eager PyTorch ops), 4-token blocks, then a prompt that
    continues the first so its prefill reads cached blocks (paged prefill with sinks)."""
    folder, hf_model = gpt_oss[:2]
    llm = LLM(folder, dtype="float32", block_size=4, max_num_seqs=4,
              enable_prefix_caching=True, environ={"HPU_SERVE_CPU_KERNELS": "0"})
    prompts = _prompts(hf_model)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    for prompt, got in zip(prompts, outputs):
        assert got == hf_greedy(hf_model, prompt, 20)
    follow_up = prompts[0] + outputs[0] + prompts[1][:5]
    got = llm.generate([follow_up], params)[0].outputs[0].token_ids
    assert llm.engine.stats().prefix_cache_hits >= 40
    assert got == hf_greedy(hf_model, follow_up, 20)


def test_fused_cpu_kernels_serve_sinks(gpt_oss) -> None:
    from server.hpu.cpu.kernels import kernels_available

    folder, hf_model = gpt_oss[:2]
    llm = LLM(folder, dtype="float32", block_size=16, max_num_seqs=4, max_model_len=128,
              enable_prefix_caching=True, environ={"HPU_SERVE_CPU_KERNELS": "1"})
    if not kernels_available():
        pytest.skip("the fused CPU kernels are not built here")
    assert llm.engine.runner.model.layers[0].self_attn.ops.name == "fused-cpu"
    prompts = _prompts(hf_model)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        assert out.outputs[0].token_ids == hf_greedy(hf_model, prompt, 16)


@pytest.mark.slow  # a compiled whole-model run
def test_compiled_graphs_match_transformers_without_serving_compilations(
        gpt_oss, tmp_path) -> None:
    folder, hf_model = gpt_oss[:2]
    buckets = tmp_path / "buckets.txt"
    buckets.write_text("# prompt buckets\n(2, [64], 0)\n# decode buckets\n(2, 1, [32])\n")
    llm = LLM(folder, dtype="float32", block_size=4, max_num_seqs=2, max_model_len=64,
              execution_mode="compile", environ={"VLLM_BUCKETING_FROM_FILE": str(buckets)})
    counters = llm.engine.counters
    assert counters.compilations(stage="warmup") > 0
    prompts = _prompts(hf_model, (37, 6))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        assert out.outputs[0].token_ids == hf_greedy(hf_model, prompt, 24)
    assert counters.compilations(stage="serving") == 0


@pytest.mark.slow  # two engines, one of them two processes
def test_tp2_matches_tp1_and_transformers(gpt_oss) -> None:
    """Heads (and their sinks) and expert widths (and their gate/up biases) split in two;
    the down biases added once."""
    from tests.engine.executor.test_tensor_parallel import SMALL, assert_same, generate

    folder, hf_model = gpt_oss[:2]
    prompts = _prompts(hf_model, (30, 9))
    reference = generate(folder, 1, prompts, 16, **SMALL)
    parallel = generate(folder, 2, prompts, 16, **SMALL)
    assert_same(reference, parallel)
    for prompt, got in zip(prompts, parallel[0]):
        assert got == hf_greedy(hf_model, prompt, 16)


# MXFP4


def test_mxfp4_dequantization_matches_transformers() -> None:
    """Every code and a spread of exponents, against transformers' own conversion (which
    also transposes to its [E, in, out] layout)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from server.models.quantized import mxfp4_dequantize

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(110, 140, (3, 10, 4), generator=gen, dtype=torch.uint8)
    ours = mxfp4_dequantize(blocks, scales)  # [E, out, in]
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
    assert ours.shape == (3, 10, 128)
    torch.testing.assert_close(ours, theirs.transpose(1, 2), atol=0, rtol=0)
    assert len(ours.unique()) > 100


def _mxfp4_checkpoint(hf_model, folder: Path, out: Path) -> torch.nn.Module:
    """The tiny model's folder with random MXFP4 experts (blocks and scales as the released
    checkpoints store them, quantization_config mxfp4); the HF model gets transformers'
    dequantization of the same bytes."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    shutil.copytree(folder, out)
    tensors = load_file(out / "model.safetensors")
    gen = torch.Generator().manual_seed(3)
    for name in [n for n in tensors if n.endswith(("gate_up_proj", "down_proj"))]:
        e, fan_in, fan_out = tensors.pop(name).shape  # transformers' [E, in, out]
        blocks = torch.randint(0, 256, (e, fan_out, fan_in // 32, 16), generator=gen,
                               dtype=torch.uint8)
        scales = torch.randint(121, 126, (e, fan_out, fan_in // 32), generator=gen,
                               dtype=torch.uint8)
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        param = hf_model.get_parameter(name)
        with torch.no_grad():
            param.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    save_file(tensors, out / "model.safetensors")
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4",
                                     "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                "model.layers.*.mlp.router",
                                                                "model.embed_tokens",
                                                                "lm_head"]}
    (out / "config.json").write_text(json.dumps(config))
    return hf_model


def test_mxfp4_checkpoint_matches_transformers_dequantized(tmp_path) -> None:
    from tests.conftest import save_tiny_model

    hf_model = save_tiny_model(tmp_path / "bf", **CASE)[0]
    _mxfp4_checkpoint(hf_model, tmp_path / "bf", tmp_path / "mx")
    assert_logits_match(str(tmp_path / "mx"), hf_model, prompt_lens=(5, 23), steps=4, block=4)


# Over HTTP: the real server, the tiny model with a harmony tokenizer

HARMONY_TOKENS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
                  "<|return|>", "<|call|>"]
# modelled on gpt-oss's own template (system and developer messages, tools as a
# TypeScript-like namespace, calls on commentary to functions.NAME, tool results from
# functions.NAME), much shortened
HARMONY_TEMPLATE = """\
{%- set ns = namespace(last_call="") -%}
<|start|>system<|message|>You are a tiny test model.
Reasoning: {{ reasoning_effort | default("medium") }}
# Valid channels: analysis, commentary, final.<|end|>
{%- if tools %}<|start|>developer<|message|># Tools
namespace functions {
{%- for t in tools %}
// {{ t.function.description }}
type {{ t.function.name }} = (_: {{ t.function.parameters | tojson }}) => any;
{%- endfor %}
} // namespace functions<|end|>
{%- endif %}
{%- for m in messages %}
{%- if m.role == "user" %}<|start|>user<|message|>{{ m.content }}<|end|>
{%- elif m.role == "system" %}<|start|>developer<|message|>{{ m.content }}<|end|>
{%- elif m.role == "assistant" and m.tool_calls %}
{%- for c in m.tool_calls %}{%- set ns.last_call = c.function.name -%}
<|start|>assistant to=functions.{{ c.function.name }}<|channel|>commentary json<|message|>\
{{ c.function.arguments | tojson }}<|call|>
{%- endfor %}
{%- elif m.role == "assistant" %}<|start|>assistant<|channel|>final<|message|>\
{{ m.content }}<|end|>
{%- elif m.role == "tool" %}<|start|>functions.{{ ns.last_call }} to=assistant\
<|channel|>commentary<|message|>{{ m.content }}<|end|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start|>assistant{% endif %}"""


@pytest.fixture(scope="module")
def harmony_folder(tmp_path_factory) -> tuple[Path, torch.nn.Module, object]:
    """The tiny gpt-oss model with the harmony markers as special tokens (BPE trained to 7
    fewer tokens, so the vocabulary size stays the model's), the template above and
    <|return|> / <|call|> as stop tokens (generation_config.json, as released)."""
    from tests.conftest import build_tokenizer, save_tiny_model

    folder = tmp_path_factory.mktemp("gpt-oss-harmony")
    hf_model = save_tiny_model(folder, **CASE)[0]
    tokenizer = build_tokenizer(hf_model.config.vocab_size - len(HARMONY_TOKENS))
    tokenizer.add_special_tokens({"additional_special_tokens": HARMONY_TOKENS})
    assert len(tokenizer) == hf_model.config.vocab_size
    tokenizer.chat_template = HARMONY_TEMPLATE
    tokenizer.save_pretrained(folder)
    ids = tokenizer.convert_tokens_to_ids(["<|return|>", "<|call|>"])
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": ids}))
    return folder, hf_model, tokenizer


TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


@pytest.mark.slow  # a server process
def test_served_over_http_with_the_harmony_parsers(harmony_folder) -> None:
    """The real server: a greedy completion equals transformers'; a chat answer of the
    random model (pushed towards the harmony markers) is read into reasoning / content /
    tool calls as the parsers read its raw tokens, streamed and whole alike; a tool round
    trip through the SDK reaches the template as transformers renders it."""
    import httpx
    import openai

    from server.api.reasoning_parsers import get_reasoning_parser
    from server.api.tool_parsers import get_tool_parser
    from tests.server_process import MODEL_NAME, TINY_FLAGS, start_server

    folder, hf_model, tokenizer = harmony_folder
    server = start_server(str(folder), *TINY_FLAGS, "--reasoning-parser", "openai_gptoss",
                          "--enable-auto-tool-choice", "--tool-call-parser", "openai")
    try:
        prompt = _prompts(hf_model, (11,))[0]
        resp = httpx.post(server.base_url + "/v1/completions", timeout=60, json={
            "model": MODEL_NAME, "prompt": prompt, "max_tokens": 12, "temperature": 0,
            "ignore_eos": True})
        assert resp.json()["choices"][0]["text"] == \
            tokenizer.decode(hf_greedy(hf_model, prompt, 12), skip_special_tokens=True)

        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")
        # seeded sampling (greedy repeats one token), the markers made likelier
        markers = {str(i): 3.0 for i in tokenizer.convert_tokens_to_ids(
            ["<|channel|>", "<|message|>", "<|end|>"])}
        ask = [{"role": "user", "content": "What is the weather in Paris?"}]
        fields = dict(model=MODEL_NAME, messages=ask, tools=[TOOL], temperature=1.0, seed=7,
                      max_tokens=48, logit_bias=markers, extra_body={"return_token_ids": True})
        whole = client.chat.completions.create(**fields)
        raw = tokenizer.decode(whole.choices[0].token_ids, skip_special_tokens=False)
        assert "<|channel|>" in raw and "<|message|>" in raw, raw  # markup to read
        reasoning, answer = get_reasoning_parser("openai_gptoss")().split(raw)
        found = get_tool_parser("openai")().extract(answer or "")
        message = whole.choices[0].message
        got = (message.reasoning_content, message.content,
               [(c.function.name, c.function.arguments) for c in message.tool_calls or []],
               whole.choices[0].finish_reason)
        assert got[:3] == (reasoning, found.content,
                           [(c.name, c.arguments) for c in found.tool_calls])
        assert _streamed(client.chat.completions.create(stream=True, **fields)) == got

        # the tool round trip: a call, its result, through the SDK into the template
        history = [*ask, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                   {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
        final = client.chat.completions.create(model=MODEL_NAME, messages=history,
                                               tools=[TOOL], max_tokens=8, temperature=0)
        assert final.choices[0].finish_reason in ("stop", "length", "tool_calls")
        rendered = httpx.post(server.base_url + "/tokenize", timeout=60, json={
            "model": MODEL_NAME, "messages": history, "tools": [TOOL]}).json()["tokens"]
        reference_history = [*history]
        reference_history[1] = {**history[1], "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
        expected = tokenizer.apply_chat_template(reference_history, tools=[TOOL],
                                                 add_generation_prompt=True, tokenize=False)
        assert 'to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}' \
            in expected and "<|start|>functions.get_weather to=assistant" in expected
        assert rendered == tokenizer.encode(expected, add_special_tokens=False)
        assert final.usage.prompt_tokens == len(rendered)
    finally:
        server.stop()


def _streamed(stream) -> tuple:
    """An SDK stream folded into (reasoning, content, [(name, arguments)], finish)."""
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                name, args = calls.get(call.index, (call.function.name, ""))
                calls[call.index] = (name, args + (call.function.arguments or ""))
            finish = choice.finish_reason or finish
    return reasoning or None, content or None, [calls[i] for i in sorted(calls)], finish
