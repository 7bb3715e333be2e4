"""Bucket planning as pure functions (no torch): which padded shapes get warmed up.

A bucket is a :class:`~server.hpu.types.Bucket` ``(batch, query, blocks)``. Prompt buckets
have ``query`` a multiple of the block size and ``blocks`` the context the queries follow in
the cache (a cached prefix, earlier chunks of the prompt); without prefix caching and chunked
prefill it is always 0, and a prefill with context runs alone (``batch == 1``), as in vLLM's
Gaudi backend, which found padding a group to its longest context too costly. Decode buckets
have ``query == 1`` and ``blocks`` = total KV blocks of the whole batch. Ranges and defaults
follow vLLM's Gaudi backend (exponential by default, linear, or an explicit file).
"""

from __future__ import annotations

import ast
import math
import re
from dataclasses import dataclass, field
from itertools import product
from pathlib import Path

from server.config import BucketingConfig, DimOverride
from server.hpu.types import Bucket

DimRange = tuple[int, int, int, int]  # (min, step, max, limit); limit unused by "lin"


def exp_range(minimum: int, step: int, maximum: int, limit: int) -> list[int]:
    """Geometric progression min -> max rounded up to multiples of step; 0 or 1 as min is
    kept verbatim and the progression then starts at step."""
    if limit <= 1:
        return [maximum]
    keep_small = minimum if minimum in (0, 1) else None
    if keep_small is not None:
        minimum = step
    values = set()
    for i in range(limit):
        v = minimum * (maximum / minimum) ** (i / (limit - 1))
        values.add(math.ceil(v / step) * step)
    if keep_small is not None:
        values.add(keep_small)
    out = sorted(values)
    if out[-1] > maximum:
        out[-1] = maximum
    return out


def lin_range(minimum: int, step: int, maximum: int) -> list[int]:
    """Ramp-up by doubling from min while below step, then multiples of step up to max
    (max is included only if it is a multiple of step, as in the reference)."""
    if minimum > maximum:
        raise ValueError(f"bucket min {minimum} > max {maximum}")
    if minimum == maximum == 0:
        return [0]
    keep_zero = minimum == 0
    if keep_zero:
        minimum = step
    ramp = []
    v = minimum
    while v < step and v <= maximum:
        ramp.append(v)
        v *= 2
    stable = list(range(step, maximum + 1, step))
    out = [x for x in ramp + stable if x >= minimum]
    return sorted(set(out)) + ([0] if keep_zero else [])


@dataclass(frozen=True, slots=True)
class BucketRanges:
    """Bucketing resolved against the engine's limits: strategy, per-dimension ranges."""

    strategy: str  # exp | lin | file
    enabled: bool
    block_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    prompt: dict[str, DimRange] = field(default_factory=dict)  # keys bs, seq (, ctx)
    decode: dict[str, DimRange] = field(default_factory=dict)  # keys bs, block
    file: str | None = None

    @property
    def with_context(self) -> bool:
        """Whether prompt buckets carry context blocks (prefix caching, chunked prefill)."""
        return "ctx" in self.prompt


def resolve_ranges(cfg: BucketingConfig, *, block_size: int, max_model_len: int,
                   max_num_seqs: int, max_num_batched_tokens: int,
                   num_blocks: int | None = None, with_context: bool = False) -> BucketRanges:
    """The reference's defaults filled in from the limits, the user's values kept;
    ``with_context``: prompt buckets get a context dimension."""
    B, mml, mns, mnbt = block_size, max_model_len, max_num_seqs, max_num_batched_tokens
    p_bs_max = _or(cfg.prompt_bs[2], 1)
    # Decode blocks: every sequence at full length is the worst case.
    block_max = max(math.ceil(mml / B) * mns, 1)
    if num_blocks is not None:
        # The reference's "3x physical" clamp: tables of one batch rarely exceed the cache.
        block_max = min(block_max, 3 * num_blocks)
    if cfg.strategy == "exp":
        # exp derives its ranges itself; like the reference, user min/step/max are not read.
        prompt = {"bs": (1, 2, p_bs_max, math.ceil(math.log2(max(p_bs_max, 1))) + 1),
                  "seq": (B, B, min(mnbt, mml), max(1, math.ceil(math.log2(min(mnbt, mml)))))}
        decode = {"bs": (1, 2, mns, math.ceil(math.log2(max(mns, 1))) + 1),
                  "block": (1, mns, block_max, math.ceil(math.log2(block_max)) + 1)}
    else:
        def dim(given: DimOverride, defaults: tuple[int, int, int]) -> DimRange:
            lo, st, hi = (_or(g, d) for g, d in zip(given, defaults))
            return (lo, st, hi, 0)

        prompt = {"bs": dim(cfg.prompt_bs, (1, 1, p_bs_max)),
                  "seq": dim(cfg.prompt_seq, (B, B, min(mnbt, mml)))}
        decode = {"bs": dim(cfg.decode_bs, (1, 32, mns)),
                  "block": dim(cfg.decode_block, (1, B, max(mml * mns // B, B)))}
    if with_context:
        # the longest context a query of at least one block can follow
        ctx_max = max((mml - B) // B, 1)
        if cfg.strategy == "exp":
            prompt["ctx"] = (0, 1, ctx_max, math.ceil(math.log2(ctx_max)) + 1)
        else:
            prompt["ctx"] = dim(cfg.prompt_ctx, (0, 1, ctx_max))
    return BucketRanges("file" if cfg.file else cfg.strategy, cfg.enabled, B, mml, mns, mnbt,
                        prompt, decode, cfg.file)


def _or(value: int | None, default: int) -> int:
    return default if value is None else value


def _range(cfg: BucketRanges, r: DimRange) -> list[int]:
    return exp_range(*r) if cfg.strategy == "exp" else lin_range(*r[:3])


def prefill_buckets(cfg: BucketRanges) -> list[Bucket]:
    if cfg.file:
        return [b for b in parse_bucket_file(cfg.file)
                if b.query != 1 and _prefill_ok(cfg, b)]
    contexts = _range(cfg, cfg.prompt["ctx"]) if cfg.with_context else [0]
    candidates = product(_range(cfg, cfg.prompt["bs"]), _range(cfg, cfg.prompt["seq"]),
                         sorted(set(contexts) | {0}))
    return sorted(b for b in map(Bucket._make, candidates) if _prefill_ok(cfg, b))


def decode_buckets(cfg: BucketRanges) -> list[Bucket]:
    if cfg.file:
        found = [b for b in parse_bucket_file(cfg.file) if b.query == 1]
        return sorted({_cap_decode(cfg, b) for b in found if b.batch <= b.blocks})
    bss = _range(cfg, cfg.decode["bs"])
    blocks = _range(cfg, cfg.decode["block"])
    out = {_cap_decode(cfg, Bucket(bs, 1, blk)) for bs, blk in product(bss, blocks) if bs <= blk}
    return sorted(out)


def verify_buckets(cfg: BucketRanges, query: int, max_batch: int | None = None
                   ) -> list[Bucket]:
    """Speculative decoding's verify buckets: the decode buckets with ``query`` tokens per
    row (the last token and the drafts), up to the smallest planned batch that holds
    ``max_batch`` rows (``disable_by_batch_size``: larger batches decode plain)."""
    decode = decode_buckets(cfg)
    batches = sorted({b.batch for b in decode})
    cap = batches[-1] if batches else 0
    if max_batch is not None:
        cap = next((bs for bs in batches if bs >= max_batch), cap)
    return sorted({Bucket(b.batch, query, b.blocks) for b in decode if b.batch <= cap})


def _prefill_ok(cfg: BucketRanges, b: Bucket) -> bool:
    bs, q, ctx = b
    if ctx and (bs != 1 or not cfg.with_context):  # a prefill with context runs alone
        return False
    return (bs <= cfg.max_num_seqs and q <= cfg.max_model_len
            and bs * q <= cfg.max_num_batched_tokens
            and ctx <= math.ceil((cfg.max_model_len - 1) / cfg.block_size))


def _cap_decode(cfg: BucketRanges, b: Bucket) -> Bucket:
    # A batch of bs sequences can never reference more than bs full-length tables.
    bs, q, blocks = b
    return Bucket(bs, q, min(blocks, bs * math.ceil(cfg.max_model_len / cfg.block_size)))


_RANGE = re.compile(r"range\(\s*(-?\d+)\s*,\s*(-?\d+)\s*(?:,\s*(-?\d+)\s*)?\)")


def parse_bucket_file(path: str) -> list[Bucket]:
    """One Python-literal 3-tuple per line; each element an int, a list of ints or
    ``range(a, b[, s])`` (end-exclusive, as in Python). The line expands to the Cartesian
    product. Blank lines and ``#`` comments are skipped. Parsed without eval."""
    buckets: set[Bucket] = set()
    for lineno, raw in enumerate(Path(path).read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            literal = _RANGE.sub(lambda m: repr(list(range(*(int(g) for g in m.groups() if g)))),
                                 line)
            value = ast.literal_eval(literal)
            dims = [[v] if isinstance(v, int) else list(v) for v in value]
            if len(dims) != 3 or not all(isinstance(x, int) and x >= 0 for d in dims for x in d):
                raise ValueError("expected (bs, query, ctx) with non-negative integers")
        except (ValueError, SyntaxError, TypeError) as exc:
            raise ValueError(f"{path}:{lineno}: bad bucket line {raw.strip()!r}: {exc}") from None
        buckets.update(Bucket(*b) for b in product(*dims))
    return sorted(buckets)


def config_lines(cfg: BucketRanges) -> list[str]:
    """The reference's start-up lines describing the ranges."""
    if cfg.file:
        return [f"Bucketing from file: {cfg.file}"]
    p, d = cfg.prompt, cfg.decode
    ctx = f", ctx:{list(p['ctx'])}" if cfg.with_context else ""
    return [
        f"Prompt bucket config (min, step, max_warmup, limit) bs:{list(p['bs'])}, "
        f"seq:{list(p['seq'])}{ctx}",
        f"Decode bucket config (min, step, max_warmup, limit) bs:{list(d['bs'])}, "
        f"block:{list(d['block'])}",
    ]


def format_plan(cfg: BucketRanges, verify: list[Bucket] | None = None) -> str:
    """The plan's log lines; ``verify``: speculative decoding's verify buckets."""
    prompt, decode = prefill_buckets(cfg), decode_buckets(cfg)
    lines = config_lines(cfg) + [
        f"Generated {len(prompt)} prompt buckets [bs, query, num_blocks]: {prompt}",
        f"Generated {len(decode)} decode buckets [bs, query, num_blocks]: {decode}",
    ]
    if verify:
        lines.append(f"Generated {len(verify)} speculative verify (decode) buckets "
                     f"[bs, query, num_blocks]: {verify}")
    return "\n".join(lines)
