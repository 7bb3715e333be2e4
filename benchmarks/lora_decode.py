"""Decode step cost with 4 distinct adapters in a batch of 16, against the base model alone,
side by side in one run (CPU, the embedded SmolLM2-135M unless --model).

    python benchmarks/lora_decode.py [--model PATH] [--batch 16] [--adapters 4] [--tokens 64]
        [--rank 16] [--rounds 4] [--dtype auto|float32|bfloat16]
        [--lora-dtype auto|float32|bfloat16] [--execution-mode auto|eager|compile]
        [--threads N] [--profile ROWS]

Writes ``--adapters`` random PEFT adapters (every projection, rank ``--rank``) for the
model, then times ``--batch`` greedy requests: 1 token (the prefill) and 1 + ``--tokens``
tokens; the difference over ``--tokens`` is the decode step. Three ways: ``base``, an
engine without ``--enable-lora``; ``lora``, an engine with ``--adapters`` slots, the
requests spread over the adapters; ``lora-off``, that engine with the same requests naming
no adapter (what a base request costs with LoRA enabled). The engines live side by side
and the rounds rotate their order (A/B then B/A), so that a noisy host's load falls on
all; prints each one's min and median step time and the ratios of the medians and of the
mins to the base (the issue's target for ``lora``: within 1.3x). ``--profile ROWS``: then
one more run of each under torch.profiler, its top ops by self CPU time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from server import LLM, LoRARequest, SamplingParams  # noqa: E402
from server.models.lora.peft import site_shapes  # noqa: E402

PEFT_NAMES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
              "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def write_adapter(folder: Path, cfg, rank: int, seed: int) -> str:
    """A PEFT-format LoRA of every projection with random A and B."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for site, shape in site_shapes(cfg).items():
        for name, out in zip(PEFT_NAMES[site.value], shape.parts):
            group = "self_attn" if site.value in ("qkv_proj", "o_proj") else "mlp"
            for layer in range(cfg.num_layers):
                key = f"base_model.model.model.layers.{layer}.{group}.{name}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, shape.inputs,
                                                              generator=gen) * 0.01
                tensors[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=gen) * 0.01
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    targets = [n for names in PEFT_NAMES.values() for n in names]
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets}))
    return str(folder)


def decode_step_ms(llm: LLM, prompts: list[list[int]], tokens: int, loras) -> float:
    """One measurement: (time of 1 + ``tokens`` tokens - time of 1 token) / ``tokens``."""
    def run(n: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        began = time.perf_counter()
        llm.generate(prompts, params, lora_request=loras)
        return time.perf_counter() - began

    return (run(1 + tokens) - run(1)) / tokens * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--lora-dtype", default="auto")
    parser.add_argument("--execution-mode", default="auto")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (1 is steadier on a loaded host)")
    parser.add_argument("--profile", type=int, default=0, metavar="ROWS",
                        help="after timing, profile one run of each engine (top ROWS ops)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    batch, count = args.batch, args.adapters
    common = dict(max_num_seqs=batch, max_model_len=512, dtype=args.dtype,
                  execution_mode=args.execution_mode)
    prompts = [[1 + i, 2 + i, 3 + i, 4 + i] for i in range(batch)]
    base = LLM(args.model, **common)
    cfg = base.engine.model_config
    with tempfile.TemporaryDirectory() as tmp:
        paths = [write_adapter(Path(tmp) / f"a{i}", cfg, args.rank, i) for i in range(count)]
        lora = LLM(args.model, enable_lora=True, max_loras=count, max_lora_rank=args.rank,
                   lora_dtype=args.lora_dtype, **common)
        loras = [LoRARequest(f"a{i % count}", i % count + 1, paths[i % count])
                 for i in range(batch)]
        engines = {"base": (base, None), "lora": (lora, loras), "lora-off": (lora, None)}
        for llm, requests in engines.values():  # first-use costs (slot copies) untimed
            decode_step_ms(llm, prompts, 2, requests)
        times: dict[str, list[float]] = {name: [] for name in engines}
        names = list(engines)
        for i in range(args.rounds):  # A/B then B/A: a load change hits all alike
            for name in names if i % 2 == 0 else names[::-1]:
                llm, requests = engines[name]
                times[name].append(decode_step_ms(llm, prompts, args.tokens, requests))
        for name, (llm, requests) in engines.items() if args.profile else ():
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                decode_step_ms(llm, prompts, args.tokens, requests)
            print(f"--- {name}: 1 + {args.tokens} tokens and 1 token, by self CPU time")
            print(prof.key_averages().table(sort_by="self_cpu_time_total",
                                            row_limit=args.profile))
    lo = {k: min(v) for k, v in times.items()}
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"decode step, batch {batch}, threads {torch.get_num_threads()}, --dtype "
          f"{args.dtype}, --lora-dtype {args.lora_dtype}, --execution-mode "
          f"{args.execution_mode}, {args.rounds} rounds of {args.tokens} tokens, {count} "
          f"adapters of rank {args.rank}")
    for k in names:
        print(f"  {k}: min {lo[k]:.2f} ms, median {med[k]:.2f} ms  "
              f"({', '.join(f'{t:.2f}' for t in times[k])})")
    for k in names[1:]:
        print(f"ratio {k}/base: of medians {med[k] / med['base']:.2f}x, of mins "
              f"{lo[k] / lo['base']:.2f}x" + (" (target <= 1.3x)" if k == "lora" else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
