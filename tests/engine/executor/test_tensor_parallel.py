"""--tensor-parallel-size on CPU (gloo): the same greedy tokens and logits as one rank.

Rank 0 runs in this process (the engine), the other ranks are spawned workers; a
recording sampler keeps the logits rank 0 samples from, step by step.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from server.config import make_engine_config
from server.engine.llm_engine import LLMEngine
from server.engine.sampling_params import SamplingParams
from server.hpu.distributed import ParallelContext
from server.models.loader import load_model, resolve_model_source
from server.models.tensor_parallel import ShardPlan
from tests.recording_sampler import RecordingSampler

pytestmark = pytest.mark.slow  # make test-fast skips it; make test (CI) runs it

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea:",
    "def fibonacci(n):",
    "Tensor parallelism splits each layer",
    "1, 2, 3, 4,",
    "Once upon a time, in a small village,",
    "The quick brown fox",
    "List three primary colors:",
]

# a small KV cache per rank (the default budget is 4 GiB each, VLLM_CPU_KVCACHE_SPACE)
SMALL = dict(block_size=16, max_num_seqs=8, max_model_len=256)



def generate(model: str | None, tp: int, prompts: list[str], max_tokens: int,
             stats: list | None = None, **options: object
             ) -> tuple[list[list[int]], list[torch.Tensor]]:
    """(greedy tokens per prompt, logits per step) at tensor-parallel size ``tp``; the
    engine's final stats are appended to ``stats``."""
    engine = LLMEngine(make_engine_config(model=model, dtype="float32",
                                          tensor_parallel_size=tp, **options))
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
        if stats is not None:
            stats.append(engine.stats())
        return [tokens[f"r{i}"] for i in range(len(prompts))], recorder.logits
    finally:
        engine.shutdown()


def assert_same(reference: tuple, parallel: tuple, atol: float = 1e-4,
                rtol: float = 1e-5) -> None:
    """Identical tokens; logits within ``atol + rtol * max |logit of the row|``. The
    relative part is float32 summation order, whose error scales with the hidden state
    rather than with each logit: a row-parallel matmul sums its inner dimension in N pieces
    plus an all-reduce, one matmul sums it whole. On SmolLM2 (logits up to ~46) the
    largest gap measured is 1.4e-4 (3e-6 relative); an all-reduce in float64 only took
    it to 1.1e-4, so the pieces' own rounding is what differs."""
    ref_tokens, ref_logits = reference
    tp_tokens, tp_logits = parallel
    assert tp_tokens == ref_tokens
    assert len(tp_logits) == len(ref_logits)
    for step, (a, b) in enumerate(zip(ref_logits, tp_logits)):
        bound = atol + rtol * a.abs().amax(dim=-1, keepdim=True)
        excess = ((a - b).abs() - bound).max().item()
        assert excess <= 0, f"step {step}: logits differ by {(a - b).abs().max().item()}"


@pytest.mark.slow
def test_smollm2_tp3_matches_tp1_greedy_and_logits() -> None:
    # 9 query heads, 3 KV heads: one KV head and three query heads per rank
    reference = generate(None, 1, PROMPTS, 32, **SMALL)
    parallel = generate(None, 3, PROMPTS, 32, **SMALL)
    assert all(len(t) == 32 for t in parallel[0])
    assert_same(reference, parallel)


def test_replicated_kv_head_tp2_matches_tp1(tiny_model_factory) -> None:
    # one KV head for two ranks: each rank holds a copy of it
    folder, _, _ = tiny_model_factory(num_kv_heads=1, tie=False)
    reference = generate(folder, 1, PROMPTS, 32, **SMALL)
    parallel = generate(folder, 2, PROMPTS, 32, **SMALL)
    assert_same(reference, parallel)


def test_moe_tp2_matches_tp1(tiny_model_factory) -> None:
    # Qwen3-MoE: sparse and dense layers, per-head q/k norms; expert widths split in two
    folder, _, _ = tiny_model_factory(model_type="qwen3_moe")
    reference = generate(folder, 1, PROMPTS, 16, **SMALL)
    parallel = generate(folder, 2, PROMPTS, 16, **SMALL)
    assert_same(reference, parallel)


@pytest.mark.slow
def test_each_rank_loads_a_third_of_smollm2(caplog: pytest.LogCaptureFixture) -> None:
    # load_model needs no collective: each rank's load runs here, one after the other
    source = resolve_model_source(None)
    device = torch.device("cpu")
    whole = load_model(source, "float32", device).num_bytes
    caplog.set_level(logging.INFO, logger="server.models.loader")
    for rank in range(3):
        loaded = load_model(source, "float32", device, ParallelContext(rank, 3))
        assert abs(loaded.num_bytes - whole / 3) < 0.01 * whole, (rank, loaded.num_bytes)
        assert loaded.config.num_heads == 3 and loaded.config.num_kv_heads == 1
        assert f"Tensor-parallel rank {rank}/3: {loaded.num_bytes / 2**20:.1f} MiB" \
            in caplog.text


def test_shard_plan_kv_heads_and_vocab(tiny_model_factory) -> None:
    from server.models.loader import load_model_config

    cfg = load_model_config(resolve_model_source(tiny_model_factory(num_kv_heads=1)[0]))
    plans = [ShardPlan.build(cfg, r, 4) for r in range(4)]
    assert [p.first_kv_head for p in plans] == [0, 0, 0, 0]
    assert [p.kv_replicas for p in plans] == [4] * 4
    assert sum(p.vocab_per_rank for p in plans) >= cfg.vocab_size
    with pytest.raises(ValueError, match="does not divide"):
        ShardPlan.build(cfg, 0, 3)  # 4 query heads


def test_ray_backend_needs_the_ray_package(monkeypatch: pytest.MonkeyPatch) -> None:
    # an optional dependency: refused up front, with the install command, where missing
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "ray" else real(name, *a))
    with pytest.raises(ValueError, match=r"pip install 'hpu-serve\[ray\]'"):
        make_engine_config(distributed_executor_backend="ray", tensor_parallel_size=2)
    # one rank starts no executor: nothing to need
    make_engine_config(distributed_executor_backend="ray", tensor_parallel_size=1)
    with pytest.raises(ValueError, match="must be mp or ray"):
        make_engine_config(distributed_executor_backend="dask", tensor_parallel_size=2)


def test_tensor_parallel_flags() -> None:
    from server.cli import build_parser
    from server.config import engine_config_from_args

    args = build_parser().parse_args(["serve", "-tp", "4", "--distributed-executor-backend",
                                      "mp"])
    parallel = engine_config_from_args(args, {}).parallel
    assert (parallel.tensor_parallel_size, parallel.distributed_executor_backend) == (4, "mp")
    args = build_parser().parse_args(["serve", "--distributed-executor-backend", "ray"])
    assert args.distributed_executor_backend == "ray"
    assert make_engine_config(environ={}).parallel.tensor_parallel_size == 1


def test_prefix_caching_under_tp2(tiny_model_factory) -> None:
    # cached-prefix prefills carry context tables: broadcast like any other input
    folder, _, _ = tiny_model_factory(num_kv_heads=1)
    shared = "the quick brown fox jumps over the lazy dog " * 4
    prompts = [shared + p for p in PROMPTS[:4]]
    one_at_a_time = {**SMALL, "max_num_seqs": 1}  # later prompts find the first's blocks
    reference = generate(folder, 1, prompts, 12, **one_at_a_time)
    stats: list = []
    parallel = generate(folder, 2, prompts, 12, stats, enable_prefix_caching=True,
                        **one_at_a_time)
    assert parallel[0] == reference[0]
    assert stats[0].prefix_cache_hits > 0


@pytest.mark.parametrize("kind", [dict(model_type="phi3"), dict(model_type="qwen3_moe"),
                                  dict(num_kv_heads=1, tie=False)])
def test_lazy_slices_equal_cut_whole_tensors(tiny_model_factory, kind: dict) -> None:
    # safetensors checkpoints are read slice by slice; the same cut of whole tensors is the
    # reference (GGUF and quantized checkpoints go that way)
    from safetensors import safe_open

    from server.models.loader import load_model_config

    source = resolve_model_source(tiny_model_factory(**kind)[0])
    cfg = load_model_config(source)
    path = f"{source.folder}/model.safetensors"
    for world in (2, 4):
        for rank in range(world):
            plan = ShardPlan.build(cfg, rank, world)
            with safe_open(path, framework="pt") as f:
                keys = list(f.keys())
                lazy = dict(plan.read((k, f.get_slice(k)) for k in keys))
                whole = dict(plan.shard((k, f.get_tensor(k)) for k in keys))
            assert lazy.keys() == whole.keys()
            for key in keys:
                assert torch.equal(lazy[key], whole[key]), (world, rank, key)


def test_fused_checkpoint_tp2_matches_tp1(tiny_model_factory) -> None:
    # Phi-3 ships qkv_proj and gate_up_proj fused: each section is cut on its own
    folder, _, _ = tiny_model_factory(model_type="phi3")
    assert_same(generate(folder, 1, PROMPTS, 16, **SMALL),
                generate(folder, 2, PROMPTS, 16, **SMALL))


UNGUARDED_SCRIPTS = {
    "LLM": """
import argparse
from server import LLM, SamplingParams
args = argparse.ArgumentParser()
args.add_argument("model")
args.add_argument("--tensor-parallel-size", type=int)
opts = args.parse_args()
llm = LLM(opts.model, tensor_parallel_size=opts.tensor_parallel_size, dtype="float32",
          block_size=16, max_num_seqs=4, max_model_len=128)
print(llm.generate("hello", SamplingParams(max_tokens=2))[0].outputs[0].token_ids)
""",
    "LLMEngine": """
import sys
from server.config import make_engine_config
from server.engine.llm_engine import LLMEngine
engine = LLMEngine(make_engine_config(model=sys.argv[1], tensor_parallel_size=int(sys.argv[3]),
                                      dtype="float32", block_size=16, max_model_len=128))
""",
}


def run_script(source: str, model: str, folder: Path) -> subprocess.CompletedProcess[str]:
    script = folder / "offline.py"
    script.write_text(source)
    root = Path(__file__).resolve().parents[3]
    return subprocess.run([sys.executable, str(script), model, "--tensor-parallel-size", "2"],
                          capture_output=True, text=True, timeout=120, check=False,
                          cwd=folder, env={**os.environ, "PYTHONPATH": str(root)})


@pytest.mark.parametrize("kind", list(UNGUARDED_SCRIPTS))
def test_a_script_without_a_main_guard_is_told_to_add_one(tiny_model, tmp_path: Path,
                                                          kind: str) -> None:
    # spawn re-runs the script's top level in each worker, which builds the engine again:
    # the workers stop at once, and both they and rank 0 say what to add
    run = run_script(UNGUARDED_SCRIPTS[kind], tiny_model[0], tmp_path)
    assert run.returncode != 0
    guard = 'if __name__ == "__main__":'
    worker_says = run.stderr.partition("Traceback")[0]
    assert f"hpu-serve: {tmp_path / 'offline.py'} builds an engine" in worker_says, run.stderr
    assert guard in worker_says
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError: tensor-parallel worker rank 1"), last
    assert "exit code 3" in last and f"put that code under `{guard}`" in last, last


def test_the_same_script_with_a_main_guard_runs(tiny_model, tmp_path: Path) -> None:
    lines = UNGUARDED_SCRIPTS["LLM"].strip().splitlines()
    imports = [line for line in lines if line.startswith(("import", "from"))]
    body = [line for line in lines if line not in imports]
    guarded = "\n".join([*imports, 'if __name__ == "__main__":',
                          *("    " + line for line in body), "    llm.shutdown()", ""])
    run = run_script(guarded, tiny_model[0], tmp_path)
    assert run.returncode == 0, run.stderr
    assert len(json.loads(run.stdout.strip().splitlines()[-1])) == 2
