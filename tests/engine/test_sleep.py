"""Sleep mode in the engine: memory freed in place (storages resized, tensors kept), the
same greedy outputs after a wake, no stale cached prefix, weights reloaded from another
checkpoint matching transformers, and no recompilation in compile mode."""

from __future__ import annotations

import pytest
import torch

from server import LLM, SamplingParams
from server.engine.errors import EngineSleepingError, RequestError
from server.engine.sleep import SleepLevel, WakeTag
from server.engine.worker.sleep import DeviceMemory, WeightsState

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 17, 42, 99, 7], [3, 11, 64, 128, 200, 31, 9], list(range(40, 80))]
COMMON = dict(dtype="float32", block_size=16, max_num_seqs=4, max_model_len=128)


def tokens(llm: LLM, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    return [r.outputs[0].token_ids for r in llm.generate(prompts, GREEDY)]


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                         min_new_tokens=n)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def eager(tiny_model):
    return LLM(tiny_model[0], enable_sleep_mode=True, enforce_eager=True, **COMMON)


@pytest.mark.parametrize("level", [SleepLevel.OFFLOAD, SleepLevel.DISCARD])
def test_sleep_wake_same_outputs_and_empty_cache(eager, level) -> None:
    engine = eager.engine
    before = tokens(eager)
    kv = engine.runner.kv_caches[0][0]
    engine.sleep(level)
    assert engine.is_sleeping
    assert kv.untyped_storage().nbytes() == 0  # freed in place: the same tensor object
    memory = engine.runner.memory
    assert memory.weights is (WeightsState.DISCARDED if level is SleepLevel.DISCARD
                              else WeightsState.RESIDENT)  # level 1 on CPU keeps them
    with pytest.raises(EngineSleepingError):
        engine.add_request("asleep", [1, 2, 3], GREEDY)
    engine.wake_up()
    assert not engine.is_sleeping
    assert engine.runner.kv_caches[0][0] is kv and kv.untyped_storage().nbytes() > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.block_manager._by_hash  # no cached prefix survives the sleep
    assert tokens(eager) == before


def test_sleep_aborts_requests_in_flight_and_frees_their_blocks(eager) -> None:
    engine = eager.engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    ended = engine.sleep(SleepLevel.OFFLOAD)
    assert sorted(o.request_id for o in ended) == ["r0", "r1", "r2"]
    assert all(o.finished and o.outputs[0].finish_reason == "abort" for o in ended)
    assert not engine.has_unfinished_requests()
    engine.wake_up(frozenset({WakeTag.WEIGHTS}))
    assert engine.is_sleeping  # the KV cache is still out
    engine.wake_up(frozenset({WakeTag.KV_CACHE}))
    assert not engine.is_sleeping


def test_offload_path_copies_through_host_memory() -> None:
    """The accelerators' level 1 (host copies, storages emptied), run on CPU tensors."""
    model = torch.nn.Linear(8, 4)
    weight = model.weight.detach().clone()
    kv = [(torch.ones(2, 3), torch.ones(2, 3))]
    memory = DeviceMemory(model, kv, offload_to_host=True, device=torch.device("cpu"))
    memory.release_kv()
    memory.offload_weights()
    assert memory.weights is WeightsState.OFFLOADED
    assert model.weight.untyped_storage().nbytes() == 0
    memory.restore_weights()
    memory.restore_kv()
    assert torch.equal(model.weight, weight) and torch.equal(kv[0][0], torch.zeros(2, 3))


def test_reload_other_weights_matches_transformers(tiny_model_factory) -> None:
    first = tiny_model_factory()
    second = tiny_model_factory(seed=1)
    llm = LLM(first[0], enable_sleep_mode=True, enforce_eager=True, **COMMON)
    before = tokens(llm)
    llm.engine.sleep(SleepLevel.DISCARD)
    llm.engine.reload_weights(second[0])
    llm.engine.wake_up()
    after = tokens(llm)
    assert after != before
    assert after == [hf_greedy(second[1], p, GREEDY.max_tokens) for p in PROMPTS]
    # awake, back to the first: in place again
    llm.engine.reload_weights(first[0])
    assert tokens(llm) == before


def test_reload_reaches_the_cpu_kernels_packed_copies(tiny_model_factory) -> None:
    """bf16 on the fused CPU kernels: decode steps run the bf16 kernel's own copy of each
    weight (a dataclass beside oneDNN's packing). A reload must refill those copies too, or
    decode keeps the old weights while prefill has the new ones."""
    from server.hpu.cpu.linear import PackedLinear

    first, second = tiny_model_factory(), tiny_model_factory(seed=1)
    common = {**COMMON, "dtype": "bfloat16"}
    llm = LLM(first[0], enable_sleep_mode=True, enforce_eager=True, **common)
    packed = [m for m in llm.engine.runner.model.modules() if isinstance(m, PackedLinear)]
    if not any(m.small is not None for m in packed):
        pytest.skip("no bf16 kernel copies here (the fused CPU kernels did not build)")
    llm.engine.sleep(SleepLevel.DISCARD)
    llm.engine.reload_weights(second[0])
    llm.engine.wake_up()
    fresh = LLM(second[0], enforce_eager=True, **common)
    assert tokens(llm) == tokens(fresh)


def test_slots_include_the_tensors_of_packed_copies() -> None:
    from server.engine.worker.sleep import tensor_slots
    from server.hpu.cpu.bf16_pack import pack_bf16

    layer = torch.nn.Linear(32, 16, dtype=torch.bfloat16)
    layer.small = pack_bf16(layer.weight, layer.bias)  # as PackedLinear holds it
    names = {s.name for s in tensor_slots(layer)}
    assert {"weight", "bias", "small.weight", "small.bias"} <= names


def test_reload_refuses_another_architecture(eager, tiny_model_factory) -> None:
    other = tiny_model_factory(num_kv_heads=4)
    before = tokens(eager)
    with pytest.raises(RequestError, match="num_kv_heads 4"):
        eager.engine.reload_weights(other[0])
    with pytest.raises(RequestError, match="not a local folder"):
        eager.engine.reload_weights("/nonexistent/model")
    assert tokens(eager) == before  # nothing changed


def test_sleep_mode_off_refuses(tiny_model) -> None:
    llm = LLM(tiny_model[0], enforce_eager=True, **COMMON)
    with pytest.raises(RequestError, match="--enable-sleep-mode"):
        llm.engine.sleep(SleepLevel.OFFLOAD)


@pytest.mark.slow
def test_compile_mode_wakes_without_recompiling(tiny_model, tmp_path) -> None:
    buckets = tmp_path / "buckets.txt"
    buckets.write_text("# prompt buckets\n(1, [32, 64], 0)\n# decode buckets\n"
                       "([1, 4], 1, [8, 32])\n")
    llm = LLM(tiny_model[0], enable_sleep_mode=True, execution_mode="compile",
              environ={"VLLM_BUCKETING_FROM_FILE": str(buckets)}, **COMMON)
    counters = llm.engine.counters
    before = tokens(llm)
    assert counters.compilations(stage="serving") == 0
    for level in SleepLevel:
        llm.engine.sleep(level)
        llm.engine.wake_up()
        assert tokens(llm) == before
    assert counters.compilations(stage="serving") == 0
