"""--generation-config (vLLM's): the model's generation_config.json gives the defaults of the
sampling fields a request leaves unset; ``vllm`` ignores it; a request's own value wins."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import openai
import pytest
from server_process import MODEL_NAME, TINY_FLAGS, start_server

from server.engine.sampling_defaults import SamplingDefaults
from server.models.errors import ModelFileError
from server.models.generation_config import generation_defaults

PROMPT = "the cat sat on"
# greedy and four new tokens, unless the request says otherwise
GENERATION = {"temperature": 0.0, "max_new_tokens": 4, "do_sample": False, "bos_token_id": 0}


@pytest.fixture(scope="module")
def model_dir(tiny_model, tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("with-generation-config") / "model"
    shutil.copytree(tiny_model[0], folder)
    (folder / "generation_config.json").write_text(json.dumps(GENERATION))
    return str(folder)


def test_auto_reads_the_sampling_fields_and_renames_max_new_tokens(model_dir) -> None:
    found, where = generation_defaults("auto", model_dir, None, {})
    assert found == {"temperature": 0.0, "max_tokens": 4}  # not do_sample, not bos_token_id
    assert where.endswith("generation_config.json")
    assert generation_defaults("vllm", model_dir, None, {})[0] == {}


def test_a_path_and_overrides(model_dir, tmp_path) -> None:
    assert generation_defaults(model_dir, str(tmp_path), None, {})[0]["max_tokens"] == 4
    # vLLM applies --override-generation-config over any mode, vllm's included
    found, where = generation_defaults("vllm", model_dir, None, {"top_k": 5})
    assert found == {"top_k": 5} and "--override-generation-config" in where
    with pytest.raises(ModelFileError, match="no generation_config.json there"):
        generation_defaults(str(tmp_path), model_dir, None, {})


def test_a_gguf_has_its_general_sampling_keys_or_nothing(smollm2_gguf) -> None:
    from server.models.gguf import open_gguf

    reader = open_gguf(str(Path(*smollm2_gguf)))
    # the embedded model's header has no general.sampling.* keys (and no json beside it)
    assert generation_defaults("auto", smollm2_gguf[0], reader, {}) == (
        {}, "the GGUF file's general.sampling.* keys")


def test_an_impossible_default_stops_start_up_naming_the_file() -> None:
    with pytest.raises(ValueError, match=r"g\.json: temperature -1"):
        SamplingDefaults.from_fields({"temperature": -1}, "g.json")


def test_defaults_fill_only_what_the_request_left_unset() -> None:
    d = SamplingDefaults(temperature=0.0, top_k=3, max_tokens=4)
    filled = d.fill({"temperature": 0.7, "top_k": None, "top_p": None, "max_tokens": None})
    assert filled == {"temperature": 0.7, "top_k": 3, "top_p": None, "max_tokens": 4}
    assert d.max_tokens_for(9) == 9 and d.max_tokens_for(None) == 4


def complete(client: openai.OpenAI, **fields) -> openai.types.Completion:
    return client.completions.create(model=MODEL_NAME, prompt=PROMPT, **fields)


@pytest.fixture(scope="module")
def auto_server(model_dir):
    srv = start_server(model_dir, *TINY_FLAGS, "--max-model-len", "64")
    yield srv
    srv.stop()


@pytest.mark.slow
def test_auto_makes_requests_without_temperature_greedy(auto_server) -> None:
    client = openai.OpenAI(base_url=auto_server.base_url + "/v1", api_key="x", max_retries=0)
    greedy = complete(client, temperature=0, max_tokens=4).choices[0].text
    for seed in range(4):  # different seeds sample differently, unless the default is greedy
        reply = complete(client, seed=seed)
        assert reply.choices[0].text == greedy
        assert reply.usage.completion_tokens <= 4  # max_new_tokens, as max_tokens
    # the request's own fields win over the model's defaults
    assert complete(client, max_tokens=7, extra_body={"ignore_eos": True}
                    ).usage.completion_tokens == 7
    sampled = {complete(client, temperature=1.0, seed=seed, max_tokens=8,
                        extra_body={"ignore_eos": True}).choices[0].text for seed in range(4)}
    assert sampled - {greedy}, "temperature 1.0 in the request was not applied"
    log = auto_server.log()
    assert "Default sampling parameters have been overridden" in log
    assert "'temperature': 0.0, 'max_tokens': 4" in log


@pytest.mark.slow
def test_chat_and_responses_take_the_defaults_too(auto_server) -> None:
    client = openai.OpenAI(base_url=auto_server.base_url + "/v1", api_key="x", max_retries=0)
    messages = [{"role": "user", "content": PROMPT}]
    greedy = client.chat.completions.create(model=MODEL_NAME, messages=messages,
                                            temperature=0, max_tokens=4)
    for seed in range(3):
        reply = client.chat.completions.create(model=MODEL_NAME, messages=messages, seed=seed)
        assert reply.choices[0].message.content == greedy.choices[0].message.content
        assert reply.usage.completion_tokens <= 4
    answer = client.responses.create(model=MODEL_NAME, input=PROMPT)
    assert answer.output_text == greedy.choices[0].message.content
    assert answer.usage.output_tokens <= 4


@pytest.mark.slow
def test_vllm_ignores_the_models_generation_config(model_dir) -> None:
    srv = start_server(model_dir, *TINY_FLAGS, "--max-model-len", "64",
                       "--generation-config", "vllm")
    try:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0)
        greedy = complete(client, temperature=0, max_tokens=8,
                          extra_body={"ignore_eos": True}).choices[0].text
        texts = {complete(client, seed=seed, max_tokens=8,
                          extra_body={"ignore_eos": True}).choices[0].text for seed in range(4)}
        assert texts - {greedy}, "requests without temperature were greedy: not vLLM's 1.0"
        # no max_new_tokens default: up to the context length
        assert complete(client, extra_body={"ignore_eos": True}).usage.completion_tokens > 4
    finally:
        srv.stop()
    assert "Default sampling parameters have been overridden" not in srv.log()


@pytest.mark.slow
def test_the_offline_llm_uses_them_when_given_no_params(model_dir) -> None:
    from server import LLM, SamplingParams

    llm = LLM(model_dir, dtype="float32", block_size=16, max_model_len=64, max_num_seqs=2,
              override_generation_config='{"top_k": 3}')
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.max_tokens) == (0.0, 3, 4)
    out = llm.generate(["the cat"])[0].outputs[0]
    greedy = llm.generate(["the cat"], SamplingParams(temperature=0, max_tokens=4))[0]
    assert len(out.token_ids) <= 4 and out.token_ids == greedy.outputs[0].token_ids
