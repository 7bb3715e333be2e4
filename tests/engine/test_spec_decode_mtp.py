"""Speculative decoding with DeepSeek-V3's own MTP layer (vLLM's ``method: mtp`` /
``deepseek_mtp``, no ``model``): a tiny random DeepSeek-V3 with a random MTP layer added
as DeepSeek stores it (tests/spec_mtp.py). Greedy output equals the target's token for
token (prompts of several lengths, n > 1, a stop string, stop tokens, preemption, prefix
caching and chunked prefill); a layer built to agree with a damped target has its drafts
accepted (which fails if the layer's inputs, norms or head are wired wrongly); compile mode
warms the layer's buckets (0 serving compilations); a target without MTP layers is refused
at start-up, saying why."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from spec_checks import all_free, draft_warmed_every_bucket, serves_without_compiling, spec_llm
from spec_checks import outputs as greedy
from spec_mtp import add_mtp, damp

from server import LLM
from server.config import SpecMethod, make_engine_config

V3 = dict(model_type="deepseek_v3", tie=False)
MTP = {"method": "mtp", "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def deepseek(tiny_model_factory) -> tuple:
    """(folder, HF model, tokenizer): the tiny DeepSeek-V3 (its config says one MTP layer;
    its checkpoint holds none)."""
    return tiny_model_factory(**V3)


@pytest.fixture(scope="module")
def with_mtp(deepseek, tmp_path_factory) -> str:
    return add_mtp(deepseek[0], tmp_path_factory.mktemp("mtp") / "random")


@pytest.fixture(scope="module")
def agreeing(deepseek, tmp_path_factory) -> dict[str, str]:
    """Damped targets (their layers add almost nothing) with an MTP layer that proposes
    what they predict: with the checkpoint's own embedding and shared head, and without
    (the target's are used)."""
    folder = tmp_path_factory.mktemp("mtp-agreeing")
    quiet = damp(deepseek[0], folder / "damped")
    return {"own": add_mtp(quiet, folder / "own", copies_embedding=True),
            "target's": add_mtp(quiet, folder / "shared", copies_embedding=True,
                                with_head=False)}


def prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist()
            for n in (1, 2, 5, 8, 9, 17, 31, 40)]


def llm(folder: str, config: dict | None, **extra) -> LLM:
    return spec_llm(folder, config, **{"block_size": 8, **extra})


def outputs(engine: LLM, batch: list[list[int]], **fields) -> list[list[list[int]]]:
    return greedy(engine, batch, **{"max_tokens": 30, **fields})


def test_config_takes_vllm_spellings() -> None:
    for method in ("mtp", "deepseek_mtp"):
        settings = make_engine_config(speculative_config={
            "method": method, "num_speculative_tokens": 2}).speculative.settings
        assert settings is not None and settings.method is SpecMethod.MTP
        assert settings.model is None and settings.query_len == 3
    with pytest.raises(ValueError, match="leave \"model\" out"):
        make_engine_config(speculative_config={"method": "mtp", "model": "",
                                               "num_speculative_tokens": 1})


def test_a_target_without_mtp_layers_is_refused(tiny_model, deepseek, tmp_path) -> None:
    with pytest.raises(ValueError, match=r"mtp: the target \(llama\) has no DeepSeek MTP"):
        llm(tiny_model[0], MTP)
    zero = tmp_path / "zero"
    shutil.copytree(deepseek[0], zero)
    config = json.loads((zero / "config.json").read_text())
    (zero / "config.json").write_text(json.dumps(config | {"num_nextn_predict_layers": 0}))
    with pytest.raises(ValueError, match="num_nextn_predict_layers is 0"):
        llm(str(zero), MTP)
    # the config says one, the checkpoint holds none
    with pytest.raises(ValueError, match=r"holds no tensors of MTP layer 3 \(model.layers.3"):
        llm(deepseek[0], MTP)


def test_a_broken_mtp_layer_or_another_model_is_refused(deepseek, with_mtp,
                                                        tmp_path) -> None:
    with pytest.raises(ValueError, match="must be the target or left out"):
        llm(with_mtp, MTP | {"model": deepseek[0]})
    assert llm(with_mtp, MTP | {"model": with_mtp}).engine.runner.draft is not None
    broken = tmp_path / "broken"
    shutil.copytree(with_mtp, broken)
    from safetensors.torch import load_file, save_file
    tensors = load_file(broken / "mtp.safetensors")
    del tensors["model.layers.3.eh_proj.weight"]
    save_file(tensors, broken / "mtp.safetensors")
    with pytest.raises(ValueError, match="mtp: MTP layer 3: .*lacks weights for .*eh_proj"):
        llm(str(broken), MTP)


@pytest.mark.slow
def test_greedy_identical_with_the_mtp_layer(deepseek, with_mtp) -> None:
    plain = llm(with_mtp, None)
    drafted = llm(with_mtp, MTP)
    batch = prompts(200)
    want = outputs(plain, batch)
    assert outputs(drafted, batch) == want
    stats = drafted.engine.stats()
    assert stats.spec_num_drafts > 0 and stats.spec_num_draft_tokens > stats.spec_num_drafts
    for fields in ({"max_tokens": 7}, {"stop_token_ids": [want[0][0][5]]},
                   {"n": 2, "max_tokens": 12}):
        assert outputs(drafted, batch, **fields) == outputs(plain, batch, **fields)
    tokenizer = deepseek[2]
    text = tokenizer.decode(want[3][0][:20])
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop
    assert outputs(drafted, batch[:5], stop=[stop]) == outputs(plain, batch[:5], stop=[stop])
    # one draft token, and more than the one layer (applied again for each)
    for k in (1, 5):
        assert outputs(llm(with_mtp, MTP | {"num_speculative_tokens": k}), batch) == want
    assert all_free(drafted)


@pytest.mark.slow
def test_preemption_prefix_caching_and_chunked_prefill_beside_it(with_mtp) -> None:
    batch = prompts(200)
    want = outputs(llm(with_mtp, None), batch)
    tight = llm(with_mtp, MTP, num_gpu_blocks_override=20, enable_prefix_caching=True)
    assert outputs(tight, batch) == want
    assert tight.engine.scheduler.num_preemptions > 0
    assert all_free(tight)
    chunked = llm(with_mtp, MTP, enable_chunked_prefill=True, max_num_batched_tokens=24,
                  enable_prefix_caching=True)
    assert outputs(chunked, batch) == want
    assert outputs(chunked, batch) == want  # again, the prompts from the prefix cache
    assert chunked.engine.stats().prefix_cache_hits >= 64
    assert all_free(chunked)


@pytest.mark.slow
@pytest.mark.parametrize("head", ["own", "target's"])
def test_an_mtp_layer_that_agrees_is_accepted(agreeing, head: str) -> None:
    folder = agreeing[head]
    batch = prompts(200)
    want = outputs(llm(folder, None), batch)
    drafted = llm(folder, MTP)
    assert outputs(drafted, batch) == want
    stats = drafted.engine.stats()
    assert stats.spec_num_accepted_tokens > 0.9 * stats.spec_num_draft_tokens > 0


@pytest.mark.slow
def test_compile_mode_warms_the_mtp_layer_and_serves_without_compiling(with_mtp,
                                                                      tmp_path) -> None:
    # a small plan (CPU compiles are slow): one prefill, one decode and its verify bucket
    buckets = tmp_path / "b.txt"
    buckets.write_text("([2], 16, [0])\n([2], 1, [8])\n")
    engine = LLM(with_mtp, dtype="float32", block_size=8, max_num_seqs=2, max_model_len=32,
                 execution_mode="compile", speculative_config=MTP,
                 environ={"VLLM_BUCKETING_FROM_FILE": str(buckets)})
    assert sum(len(b) for b in draft_warmed_every_bucket(engine).values()) == 3
    serves_without_compiling(engine, prompts(200)[3:], 16, 10, rows=2, growth=1)


def test_the_layer_shares_what_the_checkpoint_repeats_of_the_targets(agreeing,
                                                                     with_mtp) -> None:
    """An embedding / shared head equal to the target's is not kept twice; absent, the
    target's is read; a head of its own is kept."""
    from server.models.mtp import DeepSeekMTP

    for folder, shares_head in ((agreeing["own"], True), (agreeing["target's"], True),
                                (with_mtp, False)):
        runner = llm(folder, MTP).engine.runner
        assert runner.draft is not None
        layer = runner.draft.graphs.forward.head
        assert isinstance(layer, DeepSeekMTP)
        assert layer.embed_tokens is runner.model.embed_tokens
        assert (layer.lm_head is runner.model.lm_head) is shares_head


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def reference_drafts(deepseek, folder: str, tmp_path, prompt: list[int], k: int
                     ) -> list[int]:  # noqa: ANN001
    """The MTP layer's drafts after ``prompt`` computed independently: transformers'
    DeepSeek-V3 for the target's hidden states and for the MTP block (loaded as a fourth
    decoder layer), the layer's inputs and shared head by hand."""
    import transformers
    from safetensors.torch import load_file, save_file

    _, hf_model, _ = deepseek
    mtp = {k.removeprefix("model.layers.3."): v
           for k, v in load_file(f"{folder}/mtp.safetensors").items()}
    outside = ("enorm.", "hnorm.", "eh_proj.", "shared_head.", "embed_tokens.")
    four = tmp_path / "four-layers"
    if not four.exists():
        shutil.copytree(folder, four)
        (four / "mtp.safetensors").unlink()
        config = json.loads((four / "config.json").read_text())
        (four / "config.json").write_text(json.dumps(config | {"num_hidden_layers": 4}))
        tensors = load_file(four / "model.safetensors") | {
            f"model.layers.3.{n}": t for n, t in mtp.items() if not n.startswith(outside)}
        save_file(tensors, four / "model.safetensors")
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(four), dtype=torch.float32, attn_implementation="eager").eval()
    block = ref.model.layers[3]
    eps = hf_model.config.rms_norm_eps
    with torch.no_grad():
        ids = torch.tensor([prompt])
        first = int(hf_model(ids).logits[0, -1].argmax())
        tokens = prompt + [first]
        hidden = hf_model.model(torch.tensor([tokens])).last_hidden_state[0]
        prev = torch.cat([torch.zeros_like(hidden[:1]), hidden[:-1]])
        drafts: list[int] = []
        for _ in range(k):
            n = len(tokens)
            embeds = hf_model.model.embed_tokens(torch.tensor(tokens))
            x = torch.cat([_rms(embeds, mtp["enorm.weight"], eps),
                           _rms(prev, mtp["hnorm.weight"], eps)], -1) @ mtp["eh_proj.weight"].T
            positions = torch.arange(n)[None]
            mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
            out = block(x[None], position_embeddings=ref.model.rotary_emb(x[None], positions),
                        attention_mask=mask, position_ids=positions)
            out = (out[0] if isinstance(out, tuple) else out)[0]
            logits = _rms(out[-1], mtp["shared_head.norm.weight"], eps) @ \
                mtp["shared_head.head.weight"].T
            drafts.append(int(logits.argmax()))
            tokens = tokens + [drafts[-1]]
            prev = torch.cat([prev, out[-1:]])  # the layer's own output feeds the next draft
    return drafts


@pytest.mark.slow
def test_drafts_match_an_independent_mtp_computation(deepseek, with_mtp, tmp_path,
                                                     monkeypatch) -> None:
    """The first verify step's drafts equal the MTP layer computed with transformers'
    decoder layer (latent attention, experts) over its hidden states: the layer's inputs,
    positions, cache and recursion are right, not just harmless."""
    from server.engine.worker.draft_model import DraftModel

    seen: list[list[list[int]]] = []
    propose = DraftModel.propose

    def recording(self, seqs, limits):  # noqa: ANN001, ANN202
        drafts = propose(self, seqs, limits)
        seen.append(drafts)
        return drafts

    monkeypatch.setattr(DraftModel, "propose", recording)
    k = 3
    engine = llm(with_mtp, MTP | {"num_speculative_tokens": k}, max_num_seqs=1)
    for prompt in prompts(200)[:6]:
        seen.clear()
        outputs(engine, [prompt], max_tokens=8)
        assert seen and len(seen[0][0]) == k
        assert seen[0][0] == reference_drafts(deepseek, with_mtp, tmp_path, prompt, k)
