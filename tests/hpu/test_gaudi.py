"""The Gaudi path (``server/hpu/gaudi.py``) run on the bridge stand-in (``tests/fakes``): lazy
mode with HPU graphs, lazy mode without them, eager mode with ``hpu_backend``; warmup,
capture within the memory budget, zero compilations while serving, outputs equal to the CPU
path. The stand-in's recorded calls prove which bridge functions each path used."""

from __future__ import annotations

import importlib
import random
import sys
from pathlib import Path

import pytest
import torch

from server import LLM, SamplingParams
from server.config import ExecutionMode

FAKES = Path(__file__).resolve().parents[1] / "fakes"
COMMON = dict(dtype="float32", block_size=16, max_num_seqs=4, max_model_len=128, device="hpu")


@pytest.fixture()
def standin(monkeypatch: pytest.MonkeyPatch):
    """The stand-in bridge importable, HPU tensors on the CPU; everything undone after."""
    monkeypatch.syspath_prepend(str(FAKES))
    from habana_frameworks import standin as state

    from server.hpu import gaudi

    state.reset()
    monkeypatch.setattr(gaudi, "hpu_plugin",
                        lambda: gaudi.HpuPlatform(torch.device("cpu")))
    yield state
    for name in [m for m in sys.modules if m.split(".")[0] == "habana_frameworks"]:
        del sys.modules[name]
    if hasattr(torch, "hpu"):
        del torch.hpu
    importlib.invalidate_caches()


def plan(tmp_path: Path) -> dict[str, str]:
    """A small bucket plan: prompts up to 32 tokens, decode batches of 1-4."""
    path = tmp_path / "buckets.txt"
    path.write_text("(1, [16, 32], 0)\n(2, [16, 32], 0)\n(4, [16, 32], 0)\n"
                    "([1, 2, 4], 1, [4, 8, 16])\n")
    return {"VLLM_BUCKETING_FROM_FILE": str(path)}


def workload(vocab: int, seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Varied prompt lengths and output lengths, greedy (comparable across devices)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(2, 30))] for _ in range(10)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(2, 20), ignore_eos=True)
              for _ in prompts]
    return prompts, params


def tokens(outputs: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def names(state) -> list[str]:  # noqa: ANN001
    return [c.name for c in state.CALLS]


def test_lazy_mode_with_hpu_graphs(standin, tiny_model, tmp_path) -> None:
    env = {**plan(tmp_path), "PT_HPU_LAZY_MODE": "1"}
    llm = LLM(tiny_model[0], environ=env, **COMMON)
    runner = llm.engine.runner
    assert runner.platform.name == "hpu"
    assert runner.graphs.mode is ExecutionMode.GRAPHS
    planned = {p: len(b) for p, b in runner.shapes.buckets.items()}
    assert all(runner.graphs.can_replay(p, b) for p, bs in runner.shapes.buckets.items()
               for b in bs), "every bucket fits the default graph memory budget"
    captures = standin.calls("hpu_graph.capture")
    assert len(captures) == sum(planned.values())
    assert standin.calls("hpu.wrap_in_hpu_graph")[0].arguments["disable_tensor_cache"] is True
    assert standin.calls("hpu.mem_get_info"), "warmup and the KV budget query device memory"
    counters = llm.engine.counters
    warmup_compiles = counters.compilations(stage="warmup")
    assert warmup_compiles == 2 * sum(planned.values())  # a recipe, then a graph, per bucket

    prompts, params = workload(llm.engine.model_config.vocab_size, seed=1)
    ours = tokens(llm.generate(prompts, params))
    assert counters.compilations(stage="serving") == 0
    assert standin.calls("hpu_graph.replay"), "serving replays the captured graphs"
    # lazy mode needs a mark_step after every step (else graphs grow and recompile)
    forwards = [i for i, n in enumerate(names(standin)) if n == "hpu_graph.replay"]
    assert all("core.mark_step" in names(standin)[i + 1:i + 2] for i in forwards)

    cpu = LLM(tiny_model[0], **{**COMMON, "device": "cpu"})
    assert ours == tokens(cpu.generate(prompts, params))


def test_graphs_beyond_the_memory_budget_run_without_graphs(standin, tiny_model,
                                                            tmp_path) -> None:
    # 4 GiB device; a budget of ~2 KiB of graph memory holds only the first few graphs.
    env = {**plan(tmp_path), "PT_HPU_LAZY_MODE": "1", "VLLM_GRAPH_RESERVED_MEM": "1e-6"}
    llm = LLM(tiny_model[0], environ=env, **COMMON)
    shapes, graphs = llm.engine.runner.shapes, llm.engine.runner.graphs
    buckets = [(p, b) for p, bs in shapes.buckets.items() for b in bs]
    captured = [pb for pb in buckets if graphs.can_replay(*pb)]
    assert 0 < len(captured) < len(buckets)
    prompts, params = workload(llm.engine.model_config.vocab_size, seed=2)
    ours = tokens(llm.generate(prompts, params))
    assert llm.engine.counters.compilations(stage="serving") == 0  # recipes were warmed
    cpu = LLM(tiny_model[0], **{**COMMON, "device": "cpu"})
    assert ours == tokens(cpu.generate(prompts, params))


def test_lazy_mode_without_graphs(standin, tiny_model, tmp_path) -> None:
    env = {**plan(tmp_path), "PT_HPU_LAZY_MODE": "1"}
    llm = LLM(tiny_model[0], enforce_eager=True, environ=env, **COMMON)
    graphs = llm.engine.runner.graphs
    assert graphs.description == "HPU lazy mode"
    assert graphs.needs_warmup, "lazy mode compiles a recipe per shape even without graphs"
    assert not standin.calls("hpu_graph.capture")
    prompts, params = workload(llm.engine.model_config.vocab_size, seed=3)
    llm.generate(prompts, params)
    assert llm.engine.counters.compilations(stage="warmup") > 0
    assert llm.engine.counters.compilations(stage="serving") == 0


def test_eager_mode_compiles_with_hpu_backend(standin, tiny_model, tmp_path) -> None:
    standin.reset(lazy=False)
    env = {**plan(tmp_path), "PT_HPU_LAZY_MODE": "0"}
    llm = LLM(tiny_model[0], environ=env, **COMMON)
    assert llm.engine.runner.graphs.mode is ExecutionMode.COMPILE
    assert standin.calls("dynamo.hpu_backend"), "torch.compile went through hpu_backend"
    assert not standin.calls("core.mark_step")  # lazy-only: would raise in eager mode
    prompts, params = workload(llm.engine.model_config.vocab_size, seed=4)
    ours = tokens(llm.generate(prompts, params))
    assert llm.engine.counters.compilations(stage="serving") == 0
    cpu = LLM(tiny_model[0], **{**COMMON, "device": "cpu"})
    assert ours == tokens(cpu.generate(prompts, params))


def mutated_gaudi_module(old: str, new: str):  # noqa: ANN201
    """server/hpu/gaudi.py with one call changed, loaded as a separate module."""
    import types

    from server.hpu import gaudi

    source = Path(gaudi.__file__).read_text()
    assert old in source, old
    module = types.ModuleType("mutated_gaudi")
    exec(compile(source.replace(old, new), "mutated_gaudi.py", "exec"), module.__dict__)
    return module


def dummy_inputs(bs: int, q: int):  # noqa: ANN201
    from server.hpu.attention import AttentionMetadata
    from server.hpu.graph_runner import ForwardInputs

    meta = AttentionMetadata(True, 16, torch.zeros(bs * q, dtype=torch.long))
    return ForwardInputs(torch.zeros(bs, q, dtype=torch.long), torch.zeros(bs, q, dtype=torch.long),
                         meta, torch.zeros(bs, dtype=torch.long), bs)


@pytest.mark.parametrize("old, new, function", [
    ("disable_tensor_cache=True)", "disable_tensor_cache=True, max_graph=8)",
     "hpu.wrap_in_hpu_graph"),
    ("self._mark_step()", "self._mark_step(sync=True, device=0)", "core.mark_step"),
    ('metric_global("graph_compilation")', 'metric_global(name="graph_compilation", scope=0)',
     "hpu.metrics.metric_global"),
])
def test_a_wrong_bridge_call_is_caught(standin, old: str, new: str, function: str) -> None:
    from server.hpu.counters import DeviceCounters
    from server.hpu.types import Phase

    gaudi = mutated_gaudi_module(old, new)
    with pytest.raises(TypeError, match=function.replace(".", r"\.")):
        runner = gaudi.HpuLazyRunner(lambda inputs: torch.zeros(1), DeviceCounters("m"),
                                     use_graphs=True)
        runner.warm(Phase.PREFILL, (1, 16, 0), dummy_inputs(1, 16))


def test_graph_inputs_must_be_hashable_and_reachable(standin) -> None:
    """Why the runner flattens its inputs: the bridge keys graphs by hashing the arguments
    and refreshes only tensors it reaches through tuples, lists and dicts on replay."""
    import habana_frameworks.torch as htorch

    from server.hpu.gaudi import flatten_inputs, unflatten_inputs

    class Echo(torch.nn.Module):
        def forward(self, inputs):  # noqa: ANN001, ANN202
            return inputs.meta.slot_mapping.clone()

    graphed = htorch.hpu.wrap_in_hpu_graph(Echo())
    with pytest.raises(TypeError, match="unhashable"):
        graphed(dummy_inputs(1, 16))  # a dataclass as it is: the bridge cannot key a graph

    class EchoFlat(torch.nn.Module):
        def forward(self, tensors, static):  # noqa: ANN001, ANN202
            return unflatten_inputs(tensors, static).meta.slot_mapping.clone()

    graphed = htorch.hpu.wrap_in_hpu_graph(EchoFlat())
    first, second = dummy_inputs(1, 16), dummy_inputs(1, 16)
    second.meta.slot_mapping.fill_(7)
    graphed(*flatten_inputs(first))  # capture
    replayed = graphed(*flatten_inputs(second))  # same shapes: a replay with fresh tensors
    assert standin.calls("hpu_graph.replay")
    assert torch.equal(replayed, torch.full((16,), 7))


def test_a_missing_mark_step_shows_as_compilations_while_serving(standin, tiny_model,
                                                                  tmp_path, monkeypatch) -> None:
    """Lazy mode queues ops until mark_step: without it each step's ops pile onto the last
    ones, making graphs warmup never saw. The counters must show it."""
    from server.hpu import gaudi

    mutated = mutated_gaudi_module("        self._mark_step()\n", "        pass\n")
    monkeypatch.setattr(gaudi, "HpuLazyRunner", mutated.HpuLazyRunner)
    env = {**plan(tmp_path), "PT_HPU_LAZY_MODE": "1"}
    llm = LLM(tiny_model[0], enforce_eager=True, environ=env, **COMMON)
    prompts, params = workload(llm.engine.model_config.vocab_size, seed=5)
    llm.generate(prompts, params)
    assert not standin.calls("core.mark_step")
    assert llm.engine.counters.compilations(stage="serving") > 0
