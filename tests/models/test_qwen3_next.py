"""Qwen3-Next (Gated DeltaNet linear attention + gated full attention + shared-expert MoE)
and Qwen3.5's text models (the same layers, separate DeltaNet projections; dense MLPs or
experts) against transformers' own implementation on the same tiny random weights."""

from __future__ import annotations

import logging

import pytest
import torch

from server.engine.core.block_manager import BlockManager
from server.engine.core.sequence import Sequence
from server.engine.sampling_params import SamplingParams
from server.hpu.kv_cache import allocate_kv_cache
from server.hpu.state_cache import allocate_state_cache
from server.models.loader import load_model, resolve_model_source
from tests.recording_sampler import RecordingSampler

BLOCK = 4
# prefilled together as one right-padded batch: rows of very different lengths, the longest
# past one 64-token chunk of the chunked delta rule and over many KV blocks
PROMPT_LENS = (3, 70, 9, 30)
STEPS = 8
QWEN3_NEXT = dict(model_type="qwen3_next", tie=False, num_kv_heads=2)
FAMILIES = {
    "qwen3-next": QWEN3_NEXT,
    "qwen3.5": dict(model_type="qwen3_5_text", tie=False, num_kv_heads=2),
    "qwen3.5-moe": dict(model_type="qwen3_5_moe_text", tie=True, num_kv_heads=2),
}


def run_prefill_then_decode(folder: str, prompts: list[list[int]], steps: int,
                            chunk: int | None = None):
    """Prefill every prompt (in one padded batch, or ``chunk`` tokens per step), then
    decode ``steps`` greedy tokens; our logits per step, rows in prompt order."""
    from server.engine.worker.input_builder import InputBuilder
    from server.engine.worker.model_runner import ModelForward

    loaded = load_model(resolve_model_source(folder), "float32", torch.device("cpu"))
    model, cfg = loaded.model, loaded.config
    bm = BlockManager(128, BLOCK)
    kv = allocate_kv_cache(cfg.num_kv_layers, 128, BLOCK, cfg.num_kv_heads, cfg.head_dim,
                           torch.float32, torch.device("cpu"))
    slots = 8
    states = allocate_state_cache(model.state_shapes(torch.float32), slots, torch.device("cpu"))
    for conv, recurrent in states:  # stale contents a new sequence must not read
        conv.normal_()
        recurrent.normal_()
    forward = ModelForward(model, kv, states)
    inputs = InputBuilder(BLOCK, bm.pad_block_id, torch.device("cpu"), torch.float32, 4096,
                          pad_state_slot=slots)
    seqs = [Sequence(i, str(i), 0, p, SamplingParams(), 0.0) for i, p in enumerate(prompts)]
    for i, s in enumerate(seqs):
        bm.allocate(s)
        s.state_slot = slots - 1 - 2 * i  # any slot, not the row number
    with torch.inference_mode():
        if chunk is None:
            logits = [forward(inputs.prefill(seqs))]
        else:
            last = {}
            while any(s.num_computed_tokens < s.num_tokens for s in seqs):
                todo = [s for s in seqs if s.num_computed_tokens < s.num_tokens]
                lens = [min(chunk, s.num_tokens - s.num_computed_tokens) for s in todo]
                out = forward(inputs.prefill(todo, new_tokens=lens))
                for s, n, row in zip(todo, lens, out):
                    s.num_computed_tokens += n
                    last[s.seq_id] = row
            logits = [torch.stack([last[s.seq_id] for s in seqs])]
        for _ in range(steps):
            for s, row in zip(seqs, logits[-1]):
                s.output_token_ids.append(int(row.argmax()))
                bm.append_slot(s)
            logits.append(forward(inputs.decode(seqs)))
    return seqs, logits


def assert_logits_match(folder: str, hf_model: torch.nn.Module, chunk: int | None = None
                        ) -> None:
    gen = torch.Generator().manual_seed(1)
    vocab = hf_model.config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    seqs, ours = run_prefill_then_decode(folder, prompts, STEPS, chunk)
    for row, seq in enumerate(seqs):
        with torch.no_grad():
            ref = hf_model(torch.tensor([seq.all_token_ids])).logits[0].float()
        n = len(prompts[row])
        for step, logits in enumerate(ours):
            torch.testing.assert_close(logits[row], ref[n - 1 + step], atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers(tiny_model_factory, family: str) -> None:
    """One padded prefill (a 70-token row: two chunks of the delta rule, the others
    padded), then decode steps on the recurrent states."""
    assert_logits_match(*tiny_model_factory(**FAMILIES[family])[:2])


@pytest.mark.parametrize("family,chunk", [("qwen3-next", 8), ("qwen3-next", 20),
                                          ("qwen3.5", 20)])
def test_chunked_prefill_carries_the_state(tiny_model_factory, family: str, chunk: int
                                           ) -> None:
    """Prompts computed ``chunk`` tokens per step: each chunk continues the convolution's
    inputs and the recurrent state the last one left in the slot."""
    assert_logits_match(*tiny_model_factory(**FAMILIES[family])[:2], chunk=chunk)


def hf_greedy(model: torch.nn.Module, prompt: list[int], new_tokens: int) -> list[int]:
    from transformers import GenerationConfig

    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), generation_config=GenerationConfig(
            max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0))
    return out[0, len(prompt):].tolist()


@pytest.mark.slow
def test_engine_greedy_tokens_match_transformers(tiny_model_factory, caplog) -> None:
    """Through the engine (eager): prompts of several blocks and one past a delta-rule
    chunk, batched; prefix caching asked for and logged off; the state cache logged; every
    slot and block back in the pools at the end."""
    from server import LLM
    from server import SamplingParams as Params

    folder, hf_model, _ = tiny_model_factory(**QWEN3_NEXT)
    # read from the logger itself: stderr is whatever stream the process's first logging
    # set-up saw (another test file's capture, on a worker shared with it)
    plan_log = logging.getLogger("server.engine.worker.state_plan")
    plan_log.addHandler(caplog.handler)  # LLM() stops server.* propagating to the root
    caplog.set_level(logging.INFO, logger=plan_log.name)
    try:
        llm = LLM(folder, dtype="float32", block_size=BLOCK, max_num_seqs=4,
                  max_model_len=256, enable_prefix_caching=True)
    finally:
        plan_log.removeHandler(caplog.handler)
    log = caplog.text
    assert "Prefix caching: off for this hybrid model" in log
    assert "State cache: 4 slots (max_num_seqs) + 1 padding slot, 3 linear-attention" in log
    engine = llm.engine
    assert not engine.block_manager.enable_caching
    gen = torch.Generator().manual_seed(5)
    vocab = hf_model.config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (30, 9, 70)]
    params = Params(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs = [o.outputs[0].token_ids for o in llm.generate(prompts + prompts[:1], params)]
    for prompt, got in zip(prompts + prompts[:1], outputs):
        assert got == hf_greedy(hf_model, prompt, 12)
    assert engine.state_slots.num_free == 4
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.slow
def test_compile_mode_serves_on_warmed_buckets_only(tiny_model_factory, tmp_path) -> None:
    """Compile mode: the state slots are part of every warmed bucket's inputs, so serving
    (batches padded with rows on the padding slot) compiles nothing and misses no bucket,
    and the tokens are transformers'. A 32-token step budget chunks the prompts: a chunk
    after its prompt's first runs in a context bucket and continues its slot's state."""
    from server import LLM
    from server import SamplingParams as Params

    folder, hf_model, _ = tiny_model_factory(**QWEN3_NEXT)
    buckets = tmp_path / "b.txt"
    buckets.write_text("([1, 4], 32, [0, 2])\n([4], 1, [16])\n")
    llm = LLM(folder, dtype="float32", block_size=16, max_num_seqs=4, max_model_len=96,
              execution_mode="compile", enable_chunked_prefill=True,
              max_num_batched_tokens=32,
              environ={"VLLM_BUCKETING_FROM_FILE": str(buckets)})
    counters = llm.engine.counters
    runner = llm.engine.runner
    buckets_run = []
    bucket_of = runner._bucket
    runner._bucket = lambda *args: buckets_run.append(bucket_of(*args)) or buckets_run[-1]
    gen = torch.Generator().manual_seed(7)
    vocab = hf_model.config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (40, 7, 21)]
    params = Params(temperature=0.0, max_tokens=10, ignore_eos=True)
    outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    for prompt, got in zip(prompts, outputs):
        assert got == hf_greedy(hf_model, prompt, 10)
    assert counters.compilations(stage="serving") == 0
    assert sum(counters._misses.labels(counters.model_name, p)._value.get()
               for p in ("prefill", "decode")) == 0
    assert llm.engine.state_slots.num_free == 4
    assert (1, 32, 2) in buckets_run  # a chunk after 32 tokens of its prompt


@pytest.mark.slow
@pytest.mark.parametrize("chunked", [False, True], ids=["whole-prompts", "chunked-prefill"])
def test_no_slot_or_block_left_after_aborts_and_preemption(tiny_model_factory,
                                                           chunked: bool) -> None:
    """A deliberately tiny KV cache: decodes run short of blocks and preempt (the victim's
    slot is given back, its state recomputed from its tokens on return), aborted requests
    give back their slots wherever they are; afterwards every slot and block is free, and
    the greedy outputs equal those of a cache big enough never to preempt."""
    import random

    from server.config import make_engine_config
    from server.engine.llm_engine import LLMEngine

    folder, hf_model, _ = tiny_model_factory(**QWEN3_NEXT)
    limits = dict(enable_chunked_prefill=True, max_num_batched_tokens=16) if chunked else {}
    small = LLMEngine(make_engine_config(model=folder, dtype="float32", block_size=4,
                                         num_gpu_blocks_override=24, max_num_seqs=6,
                                         max_model_len=64, **limits))
    rng = random.Random(0)
    vocab = hf_model.config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(2, 30))] for _ in range(24)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 24), ignore_eos=True)
              for _ in prompts]
    to_abort = set(rng.sample(range(24), 5))
    completed: dict[str, list[int]] = {}
    aborted: set[str] = set()
    for i, (p, sp) in enumerate(zip(prompts, params)):
        small.add_request(str(i), p, sp)
    steps = 0
    slots = small.state_slots
    while small.has_unfinished_requests():
        for out in small.step():
            completed.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
        running = small.scheduler.running
        # every running sequence holds its own slot, no waiting one holds any
        assert sorted(s.state_slot for s in running) == sorted({s.state_slot for s in running})
        assert None not in {s.state_slot for s in running}
        assert all(s.state_slot is None for s in small.scheduler.waiting)
        assert slots.num_used == len(running)
        steps += 1
        if steps % 5 == 0 and to_abort:
            victim = str(to_abort.pop())
            if small.abort_request(victim) is not None:
                aborted.add(victim)
                completed.pop(victim, None)
    assert small.scheduler.num_preemptions > 0
    assert slots.num_free == slots.num_slots
    assert small.block_manager.num_free_blocks == small.block_manager.num_blocks
    assert aborted

    big = LLMEngine(make_engine_config(model=folder, dtype="float32", block_size=4,
                                       max_num_seqs=6, max_model_len=64))
    for i in completed:
        big.add_request(i, prompts[int(i)], params[int(i)])
    want: dict[str, list[int]] = {}
    while big.has_unfinished_requests():
        for out in big.step():
            want.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
    assert big.scheduler.num_preemptions == 0
    assert completed == want



def engine_greedy(folder: str, tp: int, prompts: list[list[int]], max_tokens: int
                  ) -> tuple[list[list[int]], list[torch.Tensor]]:
    from server.config import make_engine_config
    from server.engine.llm_engine import LLMEngine

    engine = LLMEngine(make_engine_config(model=folder, dtype="float32", block_size=4,
                                          max_num_seqs=4, max_model_len=128,
                                          tensor_parallel_size=tp))
    try:
        recorder = RecordingSampler(engine.runner.sampler)
        engine.runner.sampler = recorder
        engine.warmup()
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, params)
        tokens: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
        assert engine.state_slots.num_free == 4
        return [tokens[f"r{i}"] for i in range(len(prompts))], recorder.logits
    finally:
        engine.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_tensor_parallel_2_matches_transformers(tiny_model_factory, family: str) -> None:
    """TP 2: each rank holds one of the two key heads (two value heads, their states),
    half the attention heads, half of every expert and of the shared expert (or of the
    dense MLPs); the tokens are transformers' and the logits one rank's."""
    folder, hf_model, _ = tiny_model_factory(**FAMILIES[family])
    gen = torch.Generator().manual_seed(11)
    vocab = hf_model.config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (70, 5, 18)]
    one = engine_greedy(folder, 1, prompts, 10)
    two = engine_greedy(folder, 2, prompts, 10)
    for prompt, got in zip(prompts, two[0]):
        assert got == hf_greedy(hf_model, prompt, 10)
    assert two[0] == one[0]
    assert len(one[1]) == len(two[1])
    for a, b in zip(one[1], two[1]):
        torch.testing.assert_close(b, a, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_shard_plan_splits_the_delta_net_heads(tiny_model_factory, family: str) -> None:
    """Lazily read slices equal the same cuts of whole tensors, and each rank's tensors
    have the shapes its model (half the heads) asks for."""
    from safetensors import safe_open

    from server.hpu.distributed import ParallelContext
    from server.models.loader import load_model_config
    from server.models.tensor_parallel import ShardPlan, build_model
    from server.models.weight_load import TensorOrigin, load_into

    source = resolve_model_source(tiny_model_factory(**FAMILIES[family])[0])
    cfg = load_model_config(source)
    path = f"{source.folder}/model.safetensors"
    for rank in range(2):
        plan = ShardPlan.build(cfg, rank, 2)
        with safe_open(path, framework="pt") as f:
            keys = list(f.keys())
            lazy = dict(plan.read((k, f.get_slice(k)) for k in keys))
            whole = dict(plan.shard((k, f.get_tensor(k)) for k in keys))
        for key in keys:
            assert torch.equal(lazy[key], whole[key]), (rank, key)
        conv = lazy["model.layers.0.linear_attn.conv1d.weight"]
        assert conv.shape[0] == cfg.linear_attention.conv_dim // 2
        with torch.device("meta"):
            model = build_model(cfg, ParallelContext(rank, 2))[0]
        load_into(model, iter(lazy.items()), TensorOrigin(source.folder, False), dry_run=True)
    with pytest.raises(ValueError, match="linear-attention key / value heads"):
        ShardPlan.build(cfg, 0, 4)


def test_gguf_qwen35_files_are_refused(tmp_path) -> None:
    """llama.cpp's qwen35 GGUF layout is not read (qwen3next is: test_gguf_frontier.py): a
    clear start-up error, not a half-built model."""
    from gguf_files import header_only_gguf

    from server.models.gguf import gguf_model_config, open_gguf

    path = header_only_gguf(tmp_path / "q.gguf", "qwen35", block_count=4)
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'qwen35'"):
        gguf_model_config(open_gguf(str(path)))


def test_speculative_decoding_and_lora_are_refused(tiny_model_factory) -> None:
    from server.config import make_engine_config
    from server.engine.llm_engine import LLMEngine

    folder = tiny_model_factory(**QWEN3_NEXT)[0]
    with pytest.raises(ValueError, match="LoRA adapters are not supported for Qwen3-Next"):
        LLMEngine(make_engine_config(model=folder, dtype="float32", block_size=4,
                                     max_num_seqs=2, max_model_len=64, enable_lora=True))
    config = make_engine_config(model=folder, dtype="float32", block_size=4, max_num_seqs=2,
                                max_model_len=64, speculative_config={
                                    "method": "ngram", "num_speculative_tokens": 2,
                                    "prompt_lookup_max": 3})
    with pytest.raises(ValueError, match="--speculative-config is not supported for hybrid"):
        LLMEngine(config)


def test_state_cache_comes_out_of_the_kv_budget(tiny_model_factory) -> None:
    """The KV cache holds the full-attention layer only, and the KV blocks are what the
    budget holds once the state cache (every slot plus the padding one, per linear layer)
    is taken out of it."""
    from server import LLM
    from server.hpu.kv_cache import kv_bytes_per_block

    folder = tiny_model_factory(**QWEN3_NEXT)[0]
    budget = 2**20  # a budget small enough to bind (the environment variable is in GiB)
    # the CPU platform, whose budget is that variable (an accelerator's is its free memory)
    llm = LLM(folder, dtype="float32", block_size=4, max_num_seqs=16, max_model_len=256,
              device="cpu", environ={"VLLM_CPU_KVCACHE_SPACE": str(budget / 2**30)})
    runner = llm.engine.runner
    cfg = runner.model.config
    assert len(runner.kv_caches) == cfg.num_kv_layers == 1
    states = runner.state_caches
    assert len(states) == 3 and all(t.shape[0] == 17 for layer in states for t in layer)
    held = sum(t.numel() * t.element_size() for layer in states for t in layer)
    assert runner.state.nbytes == held
    per_block = kv_bytes_per_block(1, cfg.num_kv_heads, cfg.head_dim, 4, torch.float32)
    assert runner.num_blocks == (budget - held) // per_block - 1


def test_graph_runners_carry_the_state_inputs(tiny_model_factory) -> None:
    """HPU graphs take a flat tuple of tensors and CUDA graphs replay on copies of static
    inputs: both keep each row's state slot, so a captured step reads and writes the slots
    of the batch it replays."""
    from server.engine.worker.input_builder import InputBuilder, dummy_seq
    from server.hpu.cuda import _clone_inputs, _copy_inputs
    from server.hpu.gaudi import flatten_inputs, unflatten_inputs

    builder = InputBuilder(4, 16, torch.device("cpu"), torch.float32, 256, pad_state_slot=8)
    seqs = [dummy_seq(9, [1, 2, 3]), dummy_seq(5, [4, 5])]
    seqs[0].state_slot, seqs[1].state_slot = 3, 6
    inputs = builder.decode(seqs, pad_to=(4, 8))
    assert inputs.state.slots.tolist() == [3, 6, 8, 8]
    assert inputs.state.has_state.tolist() == [True, True, False, False]
    back = unflatten_inputs(*flatten_inputs(inputs)).state
    assert [t.tolist() for t in back.tensors()] == [t.tolist() for t in inputs.state.tensors()]
    static = _clone_inputs(inputs)
    seqs[0].state_slot = 1
    _copy_inputs(static, builder.decode(seqs, pad_to=(4, 8)))
    assert static.state.slots.tolist() == [1, 6, 8, 8]


def test_a_budget_the_state_cache_fills_is_a_clear_error(tiny_model_factory) -> None:
    from server import LLM

    folder = tiny_model_factory(**QWEN3_NEXT)[0]
    with pytest.raises(RuntimeError, match="the state cache .*lower --max-num-seqs"):
        LLM(folder, dtype="float32", block_size=4, max_num_seqs=64, max_model_len=64,
            device="cpu", environ={"VLLM_CPU_KVCACHE_SPACE": str(2**19 / 2**30)})


def test_chunked_rule_equals_the_token_by_token_one() -> None:
    """The chunked delta rule (prompts) against the token-by-token one (decode) on random
    inputs: several chunks, grouped value heads, a starting state, a row whose padding
    must leave its state alone."""
    from server.models.gated_delta import chunked_gated_delta_rule, recurrent_gated_delta_rule

    gen = torch.Generator().manual_seed(0)
    bs, length, k_heads, v_heads, dim = 2, 150, 2, 4, 16
    q = torch.randn(bs, length, k_heads, dim, generator=gen)
    k = torch.randn(bs, length, k_heads, dim, generator=gen)
    v = torch.randn(bs, length, v_heads, dim, generator=gen)
    g = -torch.rand(bs, length, v_heads, generator=gen)
    beta = torch.rand(bs, length, v_heads, generator=gen)
    g[1, 100:], beta[1, 100:] = 0.0, 0.0  # row 1 ends at 100 tokens
    state = torch.randn(bs, v_heads, dim, dim, generator=gen)
    out, final = chunked_gated_delta_rule(q, k, v, g, beta, state)
    ref, ref_final = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, ref_final, atol=1e-5, rtol=1e-5)
    _, short = recurrent_gated_delta_rule(q[1:, :100], k[1:, :100], v[1:, :100],
                                          g[1:, :100], beta[1:, :100], state[1:])
    torch.testing.assert_close(final[1:], short, atol=1e-5, rtol=1e-5)
