"""Where a decode step's wall time goes, by phase and by kernel, next to what each part
would take at this machine's own ceilings (measured in the same run).

    python benchmarks/step_phases.py [--model PATH] [--dtype auto] [--batch 32] [--ctx 200]
                                     [--threads N]

Two views of the same steps:
- timers around the step's phases (scheduling, input building, the forward, sampling,
  output processing): the forward's share against the Python around it;
- torch.profiler (record_shapes) over the forward: every kernel's self time, grouped into
  the linear projections (told apart by weight shape), the LM head, attention, norms,
  rotary + KV write, activation, and the rest. The forward's time the kernels do not
  account for is host time between them (Python, dispatch).
The ceiling column: linears and the LM head at the bf16 matmul ceiling (2 x rows x weight
FLOPs), attention at the read bandwidth over the KV it reads (or its FLOPs at the matmul
ceiling, whichever is longer), element-wise kernels at the read bandwidth over their bytes.
On a shared machine pass ``--threads 1``: with more threads than idle cores each of the
step's ~250 parallel regions waits for a descheduled thread and the table measures the
neighbours instead.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from roofline import matmul_ceiling_gflops, read_bandwidth_gbs
from torch.profiler import ProfilerActivity, profile

from server import LLM, SamplingParams

PHASES = ("schedule", "inputs", "forward", "sampler", "outputs")


class PhaseTimer:
    """Wall time per phase, summed over the steps measured."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.on = False
        self.unprofiled = 0.0  # the median step without the profiler

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.on:
                    self.seconds[name] += time.perf_counter() - start
        return timed


class TimedInputs:
    """The runner's input builder with its decode path timed (it has slots: no wrapping
    in place)."""

    def __init__(self, inner: Any, timer: PhaseTimer) -> None:
        self._inner = inner
        self.decode = timer.wrap("inputs", inner.decode)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def instrument(llm: LLM, timer: PhaseTimer) -> None:
    """Timers around the phases (a benchmark's instrumentation, on this LLM only)."""
    engine = llm.engine
    runner = engine.runner
    engine.scheduler.schedule = timer.wrap("schedule", engine.scheduler.schedule)
    runner.inputs = TimedInputs(runner.inputs, timer)
    runner.graphs.run = timer.wrap("forward", runner.graphs.run)
    runner.sampler = timer.wrap("sampler", runner.sampler)
    engine.output_processor.process = timer.wrap("outputs", engine.output_processor.process)


def projection_names(cfg: Any) -> dict[tuple[int, int], str]:
    """(out, in) weight shape -> projection name, from the model's config."""
    hidden, hd = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    names = {(q + 2 * kv, hidden): "qkv_proj", (hidden, q): "o_proj",
             (2 * cfg.intermediate_size, hidden): "gate_up_proj",
             (hidden, cfg.intermediate_size): "down_proj",
             (cfg.vocab_size, hidden): "lm_head"}
    return names


def classify(name: str, shapes: list[list[int]], projections: dict[tuple[int, int], str],
             vocab: int) -> str:
    if "linear" in name or name in ("aten::mm", "aten::addmm", "aten::_weight_int4pack_mm"):
        weight = shapes[1] if len(shapes) > 1 else []
        if name == "aten::_weight_int4pack_mm":
            return "linear (int4)"
        if name == "hpu_serve::bf16_linear" and len(weight) == 4:
            # the bf16 kernel's layout [N / 16, K / 2, 16, 2]: (N, K) up to its padding
            padded = {(-(-n // 16) * 16, -(-k // 2) * 2): v for (n, k), v in projections.items()}
            weight = [weight[0] * 16, weight[1] * 2]
            return padded.get(tuple(weight), f"linear {weight}")  # type: ignore[arg-type]
        return projections.get(tuple(weight), f"linear {weight}")  # type: ignore[arg-type]
    if "attention" in name:
        return "attention"
    if "rms_norm" in name:
        return "norms"
    if "rotary" in name:
        return "rotary + KV write"
    if "and_mul" in name:
        return "activation"
    if name in ("hpu_serve::argmax", "aten::argmax", "aten::log_softmax", "aten::sort",
                "aten::topk", "aten::softmax", "aten::cumsum", "aten::searchsorted",
                "aten::logsumexp", "aten::scatter", "aten::rand", "aten::masked_fill"):
        return "sampling kernels"
    if name == "aten::copy_" and shapes and shapes[0] and shapes[0][-1] == vocab:
        return "logits to fp32"
    return "other ops"


def run_steps(llm: LLM, bs: int, ctx: int, steps: int, timer: PhaseTimer,
              sampling: dict[str, Any]) -> tuple[float, Any]:
    engine = llm.engine
    # long enough that no request ends before the profiled steps do: a request that starts
    # decoding during the others' prefill chunks is that many tokens ahead
    params = SamplingParams(max_tokens=3 * steps + 120, ignore_eos=True, seed=0, **sampling)
    for i in range(bs):
        engine.add_request(f"p{i}", [7 + i] * ctx, params)
    while any(s.num_output_tokens == 0 for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    for _ in range(3):
        engine.step()
    # one thread: CPU time, which a busy shared machine does not inflate (see roofline.py)
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    plain = []
    for _ in range(steps):
        start = clock()
        engine.step()
        plain.append(clock() - start)
    # the timers run inside the profiled steps: kernels and phases of the same steps
    times = []
    timer.on = True
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
    timer.on = False
    assert engine.scheduler.num_running == bs, "a request ended before the measured steps did"
    print(f"median step {statistics.median(plain) * 1e3:.1f} ms unprofiled "
          f"({'thread CPU' if clock is time.thread_time else 'wall'} time), "
          f"{statistics.median(times) * 1e3:.1f} ms profiled (wall)")
    timer.unprofiled = statistics.median(plain)
    while engine.has_unfinished_requests():
        engine.step()
    return sum(times) / len(times), prof


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--ctx", type=int, default=200)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=args.batch, block_size=128,
              max_model_len=args.ctx + 3 * args.steps + 140)
    cfg = llm.engine.runner.model.config
    element = next(llm.engine.runner.model.parameters()).element_size()
    timer = PhaseTimer()
    instrument(llm, timer)
    sampling = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    step, prof = run_steps(llm, args.batch, args.ctx, args.steps, timer, sampling)
    ceiling = matmul_ceiling_gflops() * 1e9
    bandwidth = read_bandwidth_gbs() * 1e9

    projections = projection_names(cfg)
    kernel_s: dict[str, float] = defaultdict(float)
    for event in prof.key_averages(group_by_input_shape=True):
        kernel_s[classify(event.key, event.input_shapes, projections, cfg.vocab_size)] += (
            event.self_cpu_time_total / 1e6)
    steps = args.steps
    rows = args.batch
    ctx = args.ctx + steps
    layers = cfg.num_layers
    flops = {name: 2 * rows * out * inp * (1 if name == "lm_head" else layers)
             for (out, inp), name in projections.items()}
    kv_bytes = 2 * layers * cfg.num_kv_heads * cfg.head_dim * element * ctx * rows
    attn_flops = 4 * layers * cfg.num_heads * cfg.head_dim * ctx * rows
    hidden_bytes = rows * cfg.hidden_size * element * layers
    ideal = {name: f / ceiling for name, f in flops.items()}
    ideal["attention"] = max(kv_bytes / bandwidth, attn_flops / ceiling)
    ideal["norms"] = 2 * 3 * hidden_bytes / bandwidth  # two per layer: read x, residual; write
    ideal["activation"] = 3 * rows * cfg.intermediate_size * element * layers / bandwidth
    ideal["rotary + KV write"] = 2 * rows * (cfg.num_heads + 2 * cfg.num_kv_heads) \
        * cfg.head_dim * element * layers / bandwidth

    # The profiler and the timers read wall time; on a busy shared host a one-thread step's
    # wall time is mostly time spent descheduled. Every part is scaled by the unprofiled
    # step's CPU time / the profiled step's wall time: the shares are the profile's.
    scale = timer.unprofiled / step if torch.get_num_threads() == 1 else 1.0
    step *= scale
    for key in kernel_s:
        kernel_s[key] *= scale
    for key in timer.seconds:
        timer.seconds[key] *= scale
    forward = timer.seconds["forward"] / steps
    kernels = sum(kernel_s.values()) / steps
    print(f"sampling {sampling}")
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"dtype {next(llm.engine.runner.model.parameters()).dtype}; batch {rows}, "
          f"~{ctx} tokens of context; step {step * 1e3:.1f} ms (scaled by {scale:.2f})")
    print(f"ceilings: bf16 matmul {ceiling / 1e9:.0f} GFLOP/s, read {bandwidth / 1e9:.1f} GB/s")
    print("\n| part | ms / step | share | at the ceiling (ms) |\n|---|---:|---:|---:|")
    order = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head", "linear (int4)",
             "attention", "norms", "rotary + KV write", "activation", "logits to fp32", "sampling kernels", "other ops"]
    extra = sorted(k for k in kernel_s if k not in order)
    for name in order + extra:
        if name not in kernel_s:
            continue
        ms = kernel_s[name] / steps * 1e3
        best = f"{ideal[name] * 1e3:.2f}" if name in ideal else ""
        print(f"| {name} | {ms:.2f} | {ms / (step * 1e3):.0%} | {best} |")
    host_in_forward = max(forward - kernels, 0.0)
    print(f"| host gaps in the forward | {host_in_forward * 1e3:.2f} | "
          f"{host_in_forward / step:.0%} | 0 |")
    for phase in PHASES:
        if phase == "forward":
            continue
        ms = timer.seconds[phase] / steps * 1e3
        print(f"| {phase} (Python + kernels) | {ms:.2f} | {ms / (step * 1e3):.0%} | |")
    rest = step - sum(timer.seconds[p] for p in PHASES) / steps
    print(f"| rest of the step | {rest * 1e3:.2f} | {rest / step:.0%} | |")
    total_ideal = sum(ideal.values())
    print(f"\nstep {step * 1e3:.1f} ms; at the ceilings {total_ideal * 1e3:.1f} ms "
          f"({total_ideal / step:.2f} of it); linears + head alone at the matmul ceiling "
          f"{sum(flops.values()) / ceiling * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
