"""Speculative decoding side by side: the same model with and without
``--speculative-config``, offline (two ``LLM`` engines in one process, the embedded
SmolLM2-135M unless --model), greedy.

    python benchmarks/spec_decode.py [--model PATH] [--k 3] [--rounds 2]
        [--method ngram|draft_model|eagle|eagle3|mtp] [--draft PATH] [--quantization none]
        [--concurrency 16] [--disable-by-batch-size 0]

``--method draft_model`` drafts with ``--draft`` (default: the embedded Q4_1 GGUF, served
from its 4-bit codes); ``--quantization none`` serves the target from its dense bfloat16
weights (the embedded model's dense copy: a target that the Q4 draft is cheaper than).
``--method eagle`` / ``eagle3`` draft with the EAGLE head at ``--draft``, else a random head
built for the target in a temporary folder (it accepts almost nothing: its ratio is the
head's cost, not a speed-up). ``--method mtp`` drafts with the target's own MTP layer
(a DeepSeek-V3 ``--model``).

Two workloads, each timed in rounds A/B then B/A (A: plain, B: speculative) so drift in the
machine's load falls on both sides:

* ``grounded``: prompts whose answer repeats the prompt (copy a passage, quote it, edit
  code), one request at a time (concurrency 1). The issue's target: >= 2x output tok/s.
* ``fresh``: ``--concurrency`` (64) different open-ended prompts at once, with
  ``disable_by_batch_size`` set (0: never off), so the busy engine decodes plain.
  Target: >= 0.95x.

Prints output tok/s of each side, their ratio, the acceptance rate (accepted / drafted
tokens), whether the greedy texts are identical (they must be) and the host's 1-minute
load average (other processes on a shared host slow both sides, not always equally).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from server import LLM, SamplingParams  # noqa: E402

PASSAGE = (
    "The committee met on Tuesday to review the budget for the coming year. After a long "
    "discussion, the members agreed to increase funding for the public library by ten "
    "percent, to repair the bridge on Mill Street before the winter, and to hire two new "
    "teachers for the primary school. The mayor thanked everyone for their patience and "
    "closed the meeting at nine in the evening."
)
CODE = '''def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    return subtotal + tax


def average_price(items):
    if not items:
        return 0
    return sum(item.price for item in items) / len(items)
'''
GROUNDED = [
    f"Repeat the following text exactly, word for word:\n\n{PASSAGE}",
    f"Quote the second and third sentences of this text verbatim:\n\n{PASSAGE}",
    "Rename the variable `subtotal` to `net` in this code and print the whole code:\n\n"
    f"{CODE}",
    f"Copy this Python code exactly, without any explanation:\n\n{CODE}",
]
TOPICS = ["a lighthouse", "the moon", "a lost key", "autumn rain", "a robot chef",
          "an old map", "a quiet town", "the ocean", "a chess game", "a paper boat",
          "a snowy night", "a busy market", "a violin", "a desert road", "a garden",
          "a train station"]
STYLES = ["Write a short story about", "Describe", "Write a poem about",
          "Explain to a child what makes special"]


def fresh_prompts(count: int) -> list[str]:
    return [f"{STYLES[i // len(TOPICS) % len(STYLES)]} {TOPICS[i % len(TOPICS)]}."
            for i in range(count)]


def chat_ids(llm: LLM, text: str) -> list[int]:
    return llm.tokenizer.encode_chat([{"role": "user", "content": text}],
                                     add_generation_prompt=True)


def timed(llm: LLM, prompts: list[list[int]], params: SamplingParams, concurrent: bool
          ) -> tuple[float, int, list[str]]:
    """Seconds, output tokens and texts: all prompts at once or one at a time."""
    began = time.perf_counter()
    if concurrent:
        outs = llm.generate(prompts, params)
    else:
        outs = [out for prompt in prompts for out in llm.generate([prompt], params)]
    seconds = time.perf_counter() - began
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return seconds, tokens, [o.outputs[0].text for o in outs]


def acceptance(llm: LLM) -> tuple[int, int]:
    stats = llm.engine.spec_stats
    return (stats.num_draft_tokens, stats.num_accepted_tokens) if stats else (0, 0)


def compare(name: str, plain: LLM, spec: LLM, prompts: list[list[int]],
            params: SamplingParams, concurrent: bool, rounds: int) -> float:
    timed(plain, prompts[:2], params, concurrent)  # first-use costs out of the timing
    timed(spec, prompts[:2], params, concurrent)
    totals = {"plain": [0.0, 0], "spec": [0.0, 0]}
    drafted0, accepted0 = acceptance(spec)
    same = True
    for r in range(rounds):
        order = [("plain", plain), ("spec", spec)]
        texts = {}
        for label, llm in order if r % 2 == 0 else order[::-1]:
            seconds, tokens, texts[label] = timed(llm, prompts, params, concurrent)
            totals[label][0] += seconds
            totals[label][1] += tokens
        same = same and texts["plain"] == texts["spec"]
    drafted, accepted = acceptance(spec)
    drafted, accepted = drafted - drafted0, accepted - accepted0
    rate = {k: v[1] / v[0] for k, v in totals.items()}
    ratio = rate["spec"] / rate["plain"]
    print(f"{name:>9}: plain {rate['plain']:7.1f} tok/s  spec {rate['spec']:7.1f} tok/s  "
          f"ratio {ratio:.2f}x  acceptance {accepted}/{drafted} = "
          f"{accepted / max(drafted, 1):.2f}  identical greedy text: {same}  "
          f"(load average {os.getloadavg()[0]:.1f})", flush=True)
    return ratio


def spec_config(args: argparse.Namespace) -> dict:
    config: dict = {"method": args.method, "num_speculative_tokens": args.k,
                    "disable_by_batch_size": args.disable_by_batch_size or None}
    if args.method == "ngram":
        config.update(prompt_lookup_min=args.lookup_min, prompt_lookup_max=args.lookup_max)
    elif args.method in ("eagle", "eagle3"):
        config["model"] = args.draft or random_head(args.model, args.method)
    elif args.method == "draft_model":
        config["model"] = args.draft or embedded_gguf()
    # mtp: no model, the target's own layer drafts
    return config


def random_head(model: str | None, method: str) -> str:
    """A random EAGLE / EAGLE-3 head for ``model`` in vLLM's layout, in a temporary folder."""
    import json
    import tempfile

    import torch
    from safetensors.torch import save_file

    from server.models.loader import load_model_config, resolve_model_source

    cfg = load_model_config(resolve_model_source(model))
    h, inter, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.02

    eagle3 = method == "eagle3"
    pre = "midlayer." if eagle3 else "layers.0."
    attn_in = 2 * h if eagle3 else h
    tensors = {f"{pre}self_attn.q_proj.weight": rand(cfg.num_heads * d, attn_in),
               f"{pre}self_attn.k_proj.weight": rand(cfg.num_kv_heads * d, attn_in),
               f"{pre}self_attn.v_proj.weight": rand(cfg.num_kv_heads * d, attn_in),
               f"{pre}self_attn.o_proj.weight": rand(h, cfg.num_heads * d),
               f"{pre}mlp.gate_proj.weight": rand(inter, h),
               f"{pre}mlp.up_proj.weight": rand(inter, h),
               f"{pre}mlp.down_proj.weight": rand(h, inter),
               f"{pre}post_attention_layernorm.weight": torch.ones(h),
               "fc.weight": rand(h, (3 if eagle3 else 2) * h)}
    config = {"architectures": ["LlamaForCausalLMEagle3" if eagle3 else "LlamaForCausalLM"],
              "hidden_size": h, "intermediate_size": inter, "num_hidden_layers": 1,
              "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
              "head_dim": d, "vocab_size": cfg.vocab_size, "rms_norm_eps": cfg.rms_norm_eps,
              "rope_theta": cfg.rope_theta,
              "max_position_embeddings": cfg.max_position_embeddings}
    if eagle3:
        tensors |= {f"{pre}input_layernorm.weight": torch.ones(h),
                    f"{pre}hidden_norm.weight": torch.ones(h), "norm.weight": torch.ones(h),
                    "lm_head.weight": rand(cfg.vocab_size, h)}
    folder = tempfile.mkdtemp(prefix=f"{method}-head-")
    save_file(tensors, f"{folder}/model.safetensors")
    Path(folder, "config.json").write_text(json.dumps(config))
    return folder


def embedded_gguf() -> str:
    """The embedded SmolLM2-135M Q4_1 GGUF file."""
    from server.models.loader import DEFAULT_MODEL_FILE, resolve_model_source

    return str(Path(resolve_model_source(None).folder) / DEFAULT_MODEL_FILE)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="target (default: embedded SmolLM2)")
    parser.add_argument("--method", default="ngram",
                        choices=("ngram", "draft_model", "eagle", "eagle3", "mtp"))
    parser.add_argument("--draft", default=None,
                        help="draft_model: the draft checkpoint; eagle / eagle3: the head")
    parser.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    parser.add_argument("--lookup-min", type=int, default=2)
    parser.add_argument("--lookup-max", type=int, default=4)
    parser.add_argument("--disable-by-batch-size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--fresh-tokens", type=int, default=32)
    parser.add_argument("--skip-fresh", action="store_true")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--quantization", default=None,
                        help="the target's --quantization (none: a GGUF's dense weights)")
    args = parser.parse_args()
    common: dict = {"max_num_seqs": args.concurrency, "max_model_len": 1024}
    if args.dtype:
        common["dtype"] = args.dtype
    if args.quantization:
        common["quantization"] = args.quantization
    plain = LLM(args.model, **common)
    spec = LLM(args.model, speculative_config=spec_config(args), **common)
    print(f"speculative config: {spec_config(args)}", flush=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    grounded = [chat_ids(plain, text) for text in GROUNDED]
    ratio = compare("grounded", plain, spec, grounded, greedy, False, args.rounds)
    print(f"           concurrency 1, target >= 2x: {'met' if ratio >= 2 else 'missed'}")
    if not args.skip_fresh:
        fresh = [chat_ids(plain, text) for text in fresh_prompts(args.concurrency)]
        params = SamplingParams(temperature=0.0, max_tokens=args.fresh_tokens, ignore_eos=True)
        ratio = compare("fresh", plain, spec, fresh, params, True, args.rounds)
        print(f"           concurrency {args.concurrency}, target >= 0.95x: "
              f"{'met' if ratio >= 0.95 else 'missed'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
