"""A bucket plan fitted to observed traffic under a bucket-count or warmup-time budget.

Input: the histogram of unpadded step shapes (``GET /buckets/observed``, see
:mod:`server.hpu.buckets.observed`). Output: buckets for ``VLLM_BUCKETING_FROM_FILE``.

Objective (per step, summed over the observed steps): padded query tokens (``bs * query``
of the bucket minus the tokens the step really had: what ``hpu_serve:padded_tokens`` counts)
plus ``kv_weight`` times the padded KV positions (context blocks of the bucket beyond the
step's, times the block size): a padded KV position is read by attention but costs far less
than a padded query token running through every layer.

Algorithm: the shapes split into three groups, each a grid of two dimensions (the runtime's
rules: a prefill with context runs alone):

* prompts without context: (bs, query); prompts with context: (query, ctx blocks), bs 1;
* decodes: (bs, total blocks).

1. Per dimension, an exact 1-D dynamic programme (optimal "k-quantisation" of a line) gives,
   for every k, the k cut values minimising the padding of that dimension's marginal: each
   observed value ``v`` weighted by how many tokens one unit of padding there costs (for
   ``query``: the steps' rows; for ``bs``: their query lengths...). The largest observed
   value is always a cut, so every shape is covered. Query cuts are multiples of
   ``query_step`` (32 tokens; the reference's buckets step by the block size).
2. A plan for per-dimension counts ``k`` maps every observed shape to its cut values in
   each dimension; the plan is the set of buckets some shape lands in (grid points nobody
   uses are never warmed). A landing point that the engine would reject (decode rows beyond
   blocks, a prompt beyond the token budget) is replaced by a valid one still dominating it.
   Each group also keeps its corner (the largest cut of every dimension), so a later shape
   anywhere inside the observed envelope still fits a bucket; by default the largest cut of
   each dimension is the engine's limit (not the largest value observed), so the corner
   holds any step the engine can schedule: unforeseen traffic pads more, but never misses.
3. Greedy allocation: start at k = 1 everywhere; repeatedly take the single ``k += 1`` with
   the best padding saved per unit of budget spent (buckets, or estimated warmup seconds),
   among those that keep the plan within budget; stop when none does.

The result is checked by replaying every observed shape with the runtime's own bucket choice
(:func:`server.hpu.buckets.lookup.smallest_dominating`): 0 misses by construction.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from server.hpu.buckets.lookup import smallest_dominating
from server.hpu.buckets.observed import FORMAT
from server.hpu.types import Bucket, BucketLimits, Phase

# A padded KV position in padded query tokens (--kv-weight): a padded query token runs
# through every layer's matmuls, a padded KV position is only read by attention; 1/256
# makes a 128-token block weigh half a padded token.
KV_WEIGHT = 1 / 256
MAX_CANDIDATES = 192  # per dimension; more distinct values are thinned (rounded up)
MAX_CUTS = 64  # per dimension
# Granularity of prompt query buckets (--query-step). The reference steps them by the block
# size (128 on Gaudi), which pads a 145-token prompt to 256 whatever the plan; the runtime
# takes any query length (pad tokens write to the padding block), so a finer step lets the
# fit follow the traffic.
QUERY_STEP = 32


@dataclass(slots=True)
class Observed:
    """The parsed ``/buckets/observed`` document."""

    block_size: int
    shapes: dict[Phase, dict[Bucket, int]]
    real_tokens: dict[Phase, int]
    warmup: dict[Phase, dict[Bucket, float]] = field(default_factory=dict)
    limits: BucketLimits | None = None
    plan: dict[Phase, list[Bucket]] | None = None
    static_shapes: bool = True  # recorded by an engine scheduling for graphs (not eager)

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Observed:
        if doc.get("format") != FORMAT:
            raise ValueError(f"not an observed-shapes document (format {doc.get('format')!r})")
        phases = doc["phases"]
        plan = doc.get("plan")
        shapes: dict[Phase, dict[Bucket, int]] = {p: {} for p in Phase}
        for p in Phase:
            for bs, q, ctx, n in phases[str(p)]["shapes"]:
                if p is Phase.PREFILL and ctx and bs > 1:
                    # an eager engine batches prefills after a context; graphs run each
                    # alone (bs 1): count them as that many steps of the batch's extent
                    bs, n = 1, n * bs
                shape = Bucket(bs, q, ctx)
                shapes[p][shape] = shapes[p].get(shape, 0) + n
        limits = doc.get("limits")
        return cls(
            block_size=int(doc["block_size"]),
            shapes=shapes,
            real_tokens={p: int(phases[str(p)]["real_tokens"]) for p in Phase},
            warmup={p: {Bucket(w[0], w[1], w[2]): float(w[3])
                        for w in doc.get("warmup_seconds", {}).get(str(p), [])} for p in Phase},
            limits=None if limits is None else BucketLimits.from_json(limits),
            plan=None if plan is None else {p: [Bucket(*b) for b in plan[str(p)]] for p in Phase},
            static_shapes=bool(doc.get("static_shapes", True)),
        )


class WarmupModel:
    """Seconds to warm one bucket: the measured value where there is one, otherwise a
    least-squares line ``a + b * tokens`` per phase through the measured buckets (tokens:
    rows x query for prompts, rows x blocks for decodes). Without measurements, 1 s each."""

    def __init__(self, measured: Mapping[Phase, Mapping[Bucket, float]]) -> None:
        self.measured = {p: dict(measured.get(p, {})) for p in Phase}
        self.measured_any = any(self.measured.values())
        self._line: dict[Phase, tuple[float, float]] = {}
        for phase, points in self.measured.items():
            xs = np.array([_work(phase, b) for b in points], dtype=float)
            ys = np.array(list(points.values()), dtype=float)
            if len(points) >= 2 and np.ptp(xs) > 0:
                slope, icpt = np.polyfit(xs, ys, 1)
                self._line[phase] = (max(float(icpt), 0.0), max(float(slope), 0.0))
            else:
                self._line[phase] = (float(ys.mean()) if len(ys) else 1.0, 0.0)

    def seconds(self, phase: Phase, bucket: Bucket) -> float:
        if bucket in self.measured[phase]:
            return self.measured[phase][bucket]
        icpt, slope = self._line[phase]
        return icpt + slope * _work(phase, bucket)

    def total(self, plan: Mapping[Phase, Sequence[Bucket]]) -> float:
        return sum(self.seconds(p, b) for p in Phase for b in plan.get(p, ()))


def _work(phase: Phase, b: Bucket) -> int:
    return b.batch * b.query if phase is Phase.PREFILL else b.batch * b.blocks


@dataclass(slots=True)
class PlanCost:
    """A plan replayed against the observed steps with the runtime's bucket choice."""

    buckets: dict[Phase, int]
    padded_tokens: dict[Phase, int]  # bucket tokens minus real tokens, over covered steps
    padded_kv_blocks: dict[Phase, int]  # context blocks beyond the step's own
    misses: dict[Phase, int]  # steps that fit no bucket (they would run unpadded, compiling)
    warmup_seconds: float

    @property
    def total_padded_tokens(self) -> int:
        return sum(self.padded_tokens.values())

    @property
    def total_buckets(self) -> int:
        return sum(self.buckets.values())


def evaluate(obs: Observed, plan: Mapping[Phase, Sequence[Bucket]],
             warmup: WarmupModel) -> PlanCost:
    """Replays every observed shape against ``plan`` as :class:`ShapePlanner` would."""
    padded: dict[Phase, int] = {}
    kv: dict[Phase, int] = {}
    misses: dict[Phase, int] = {}
    for phase in Phase:
        buckets = sorted(set(plan.get(phase, ())))
        run_tokens = kv_blocks = missed = missed_real = 0
        for shape, n in obs.shapes[phase].items():
            b = smallest_dominating(buckets, shape)
            if b is None:
                missed += n
                # a miss runs at its exact shape: no padding, but a compilation while serving
                missed_real += n * _tokens(phase, shape)
                continue
            run_tokens += n * _tokens(phase, b)
            kv_blocks += n * (b.blocks - shape.blocks)
        padded[phase] = max(0, run_tokens + missed_real - obs.real_tokens[phase])
        kv[phase], misses[phase] = kv_blocks, missed
    return PlanCost({p: len(set(plan.get(p, ()))) for p in Phase}, padded, kv, misses,
                    warmup.total(plan))


def _tokens(phase: Phase, b: Bucket) -> int:
    return b.batch * b.query if phase is Phase.PREFILL else b.batch


def optimal_cuts(values: Sequence[int], weights: Sequence[float], max_k: int
                 ) -> list[list[int]]:
    """``out[k-1]``: the k cut values (a subset of ``values``, the largest always in)
    minimising ``sum(w * (cut(v) - v))`` where ``cut(v)`` is the smallest cut >= v.
    Exact O(k n^2) dynamic programme, vectorised over the previous cut."""
    v = np.asarray(values, dtype=float)
    w = np.asarray(weights, dtype=float)
    n = len(v)
    W = np.concatenate([[0.0], np.cumsum(w)])  # prefix sums: weights, weighted values
    S = np.concatenate([[0.0], np.cumsum(w * v)])
    # best[j]: least cost covering values[0..j] with the last cut at values[j]
    best = v * W[1:] - S[1:]
    back: list[np.ndarray] = []
    out = [[int(v[-1])]]
    for _ in range(2, min(max_k, n) + 1):
        new = np.full(n, np.inf)
        arg = np.zeros(n, dtype=int)
        for j in range(1, n):
            # previous cut at i < j; values i+1..j pad up to values[j]
            i = np.arange(j)
            cost = best[:j] + v[j] * (W[j + 1] - W[i + 1]) - (S[j + 1] - S[i + 1])
            arg[j] = int(np.argmin(cost))
            new[j] = cost[arg[j]]
        back.append(arg)
        best = new
        cuts, j = [n - 1], n - 1
        for arg_k in reversed(back):
            j = int(arg_k[j])
            cuts.append(j)
        out.append(sorted(int(v[c]) for c in cuts))
    return out


def _thin(values: dict[int, float], limit: int) -> tuple[list[int], list[float]]:
    """Distinct values with their weights; past ``limit`` of them, values are rounded up to
    a geometric grid (finer than the cuts will ever be), so cuts still cover them."""
    if len(values) > limit:
        lo, hi = min(values), max(values)
        ratio = (hi / max(lo, 1)) ** (1 / limit)
        grid: dict[int, float] = {}
        for val, wt in values.items():
            k = math.ceil(math.log(max(val, 1) / max(lo, 1)) / math.log(ratio) - 1e-9)
            g = min(hi, max(val, math.ceil(max(lo, 1) * ratio ** k)))
            grid[g] = grid.get(g, 0.0) + wt
        values = grid
    keys = sorted(values)
    return keys, [values[k] + 1e-9 for k in keys]  # tiny weight: unused values still cut


@dataclass(slots=True)
class _Group:
    """Shapes fitted as one 2-D grid: dims are indices into the bucket tuple."""

    phase: Phase
    dims: tuple[int, int]
    shapes: np.ndarray  # rows: bs, query, ctx, count
    cuts: list[list[list[int]]]  # per dim, per k-1: the cut values


def _groups(obs: Observed, kv_weight: float, cover_limits: bool,
            query_step: int) -> list[_Group]:
    B = obs.block_size
    lim = obs.limits if cover_limits and obs.limits else BucketLimits()
    # the largest value each dimension can take within the engine's limits (when known)
    query_top = min(lim.max_num_batched_tokens or 0, lim.max_model_len or 0)
    per_seq = -(-(lim.max_model_len or 0) // B)
    blocks_top = (lim.max_num_seqs or 0) * per_seq
    if lim.num_blocks:
        blocks_top = min(blocks_top, 3 * lim.num_blocks)  # the reference's clamp
    out = []
    prompt = [(*s, n) for s, n in obs.shapes[Phase.PREFILL].items()]
    for with_ctx in (False, True):
        rows = np.array([r for r in prompt if (r[2] > 0) == with_ctx], dtype=np.int64)
        if len(rows):
            dims = (1, 2) if with_ctx else (0, 1)
            tops = {1: query_top // query_step * query_step, 2: max(per_seq - 1, 0)}
            out.append(_fit_group(Phase.PREFILL, dims, rows, B, kv_weight, tops, query_step,
                                  obs.limits.max_num_batched_tokens if obs.limits else None))
    rows = np.array([(*s, n) for s, n in obs.shapes[Phase.DECODE].items()], dtype=np.int64)
    if len(rows):
        tops = {0: lim.max_num_seqs or 0, 2: blocks_top}
        out.append(_fit_group(Phase.DECODE, (0, 2), rows, B, kv_weight, tops))
    return out


def _fit_group(phase: Phase, dims: tuple[int, int], rows: np.ndarray, B: int,
               kv_weight: float, tops: Mapping[int, int], query_step: int = 1,
               max_num_batched_tokens: int | None = None) -> _Group:
    """Candidate cuts per dimension; ``tops``: per dimension, a value the largest cut must
    reach (the engine's limit) even if no step was that large."""
    if phase is Phase.PREFILL:  # query cuts are multiples of the query step...
        rows = rows.copy()
        aligned = -(-rows[:, 1] // query_step) * query_step
        if max_num_batched_tokens:  # ...unless that would take the batch past the budget
            aligned = np.maximum(rows[:, 1],
                                 np.minimum(aligned, max_num_batched_tokens // rows[:, 0]))
        rows[:, 1] = aligned
    cuts = []
    for d in dims:
        # tokens that one unit of padding in dimension d costs, per step
        if d == 2:
            unit = np.full(len(rows), kv_weight * B)
        elif phase is Phase.DECODE:
            unit = np.ones(len(rows))
        else:
            unit = rows[:, 1 - d].astype(float)  # bs costs query tokens, query costs rows
        marg: dict[int, float] = {}
        for val, u, n in zip(rows[:, d], unit, rows[:, 3]):
            marg[int(val)] = marg.get(int(val), 0.0) + float(u * n)
        if tops.get(d, 0) > max(marg):
            marg[tops[d]] = 0.0  # never a landing value, but the top cut: covers the rest
        values, weights = _thin(marg, MAX_CANDIDATES)
        cuts.append(optimal_cuts(values, weights, MAX_CUTS))
    return _Group(phase, dims, rows, cuts)


def _landing(group: _Group, ks: tuple[int, int], limits: BucketLimits | None,
             block_size: int, query_step: int) -> np.ndarray:
    """Per shape, the bucket it lands in for ``ks`` cuts per dimension (valid ones)."""
    s = group.shapes
    out = s[:, :3].copy()
    for axis, (d, k) in enumerate(zip(group.dims, ks)):
        cuts = np.array(group.cuts[axis][k - 1])
        out[:, d] = cuts[np.searchsorted(cuts, s[:, d], side="left")]
    if group.phase is Phase.DECODE:
        out[:, 2] = np.maximum(out[:, 2], out[:, 0])  # the engine drops rows > blocks
        if limits and limits.max_model_len is not None and block_size:
            # nor can a batch hold more than full-length tables (the engine caps it too)
            per_seq = -(-limits.max_model_len // block_size)
            out[:, 2] = np.minimum(out[:, 2], out[:, 0] * per_seq)
    elif limits:
        # beyond the step's token budget or the model length: fall back to the shape's own
        # batch size, then to the longest step-aligned query that batch size allows (one
        # bucket per batch size, not one per shape)
        if limits.max_model_len is not None:
            out[:, 1] = np.minimum(out[:, 1], limits.max_model_len)
        budget = _or_unbounded(limits.max_num_batched_tokens)
        over = out[:, 0] * out[:, 1] > budget
        out[over, 0] = s[over, 0]
        over = out[:, 0] * out[:, 1] > budget
        out[over, 1] = np.maximum(s[over, 1], budget // out[over, 0] // query_step * query_step)
    return out


def suggest(obs: Observed, *, max_buckets: int | None = None,
            warmup_budget: float | None = None, kv_weight: float = KV_WEIGHT,
            warmup: WarmupModel | None = None, cover_limits: bool = True,
            query_step: int = QUERY_STEP) -> dict[Phase, list[Bucket]]:
    """The plan covering every observed shape with the least padding within the budget
    (bucket count and/or estimated warmup seconds); see the module docstring.
    ``cover_limits``: the largest buckets reach the engine's limits (known from the dump),
    so traffic larger than any observed still finds a bucket; otherwise only the observed
    envelope is covered."""
    empty = [str(p) for p in Phase if not obs.shapes[p]]
    if empty:  # a plan without them would make every such step a miss
        raise ValueError(f"no {' or '.join(empty)} steps observed yet: serve traffic first")
    warmup = warmup or WarmupModel(obs.warmup)
    groups = _groups(obs, kv_weight, cover_limits, query_step)
    B = obs.block_size
    cache: dict[tuple[int, tuple[int, int]], tuple[float, dict[Bucket, None], float]] = {}

    def state(gi: int, ks: tuple[int, int]) -> tuple[float, dict[Bucket, None], float]:
        """(padding cost, buckets, warmup seconds) of one group at ``ks``."""
        key = (gi, ks)
        if key not in cache:
            g = groups[gi]
            land = _landing(g, ks, obs.limits, B, query_step)
            n = g.shapes[:, 3]
            q = land[:, 1] if g.phase is Phase.PREFILL else np.ones(len(land), dtype=np.int64)
            cost = float((n * land[:, 0] * q).sum() + kv_weight * B *
                         (n * (land[:, 2] - g.shapes[:, 2])).sum())
            buckets = dict.fromkeys(Bucket(*(int(x) for x in b))
                                    for b in np.unique(land, axis=0))
            # the group's corner too: any later shape inside the observed envelope fits
            top = [int(land[:, d].max()) for d in range(3)]
            for axis, d in enumerate(g.dims):
                top[d] = max(top[d], g.cuts[axis][ks[axis] - 1][-1])
            if (g.phase is Phase.DECODE and obs.limits
                    and obs.limits.max_model_len is not None):
                top[2] = min(top[2], top[0] * -(-obs.limits.max_model_len // B))
            corner = Bucket(top[0], top[1], top[2])
            if g.phase is Phase.DECODE or corner.batch * corner.query <= _or_unbounded(
                    obs.limits.max_num_batched_tokens if obs.limits else None):
                buckets[corner] = None
            secs = sum(warmup.seconds(g.phase, b) for b in buckets)
            cache[key] = (cost, buckets, secs)
        return cache[key]

    def totals(ks: list[tuple[int, int]]) -> tuple[float, int, float]:
        parts = [state(i, k) for i, k in enumerate(ks)]
        return (sum(p[0] for p in parts), sum(len(p[1]) for p in parts),
                sum(p[2] for p in parts))

    def fits(n_buckets: int, secs: float) -> bool:
        return ((max_buckets is None or n_buckets <= max_buckets)
                and (warmup_budget is None or secs <= warmup_budget + 1e-9))

    ks = [(1, 1) for _ in groups]
    cost, n_buckets, secs = totals(ks)
    if not fits(n_buckets, secs):
        raise ValueError(f"budget too small: covering every observed shape takes at least "
                         f"{n_buckets} buckets, ~{secs:.0f} s of warmup")
    while True:
        best: tuple[float, list[tuple[int, int]], tuple[float, int, float]] | None = None
        for gi, g in enumerate(groups):
            for axis in (0, 1):
                k = list(ks[gi])
                if k[axis] >= len(g.cuts[axis]):
                    continue
                k[axis] += 1
                trial = ks[:gi] + [(k[0], k[1])] + ks[gi + 1:]
                t_cost, t_n, t_secs = totals(trial)
                if t_cost >= cost or not fits(t_n, t_secs):
                    continue
                spent = (t_secs - secs) if warmup_budget is not None else (t_n - n_buckets)
                gain = (cost - t_cost) / max(spent, 1e-6)
                if best is None or gain > best[0]:
                    best = (gain, trial, (t_cost, t_n, t_secs))
        if best is None:
            break
        ks, (cost, n_buckets, secs) = best[1], best[2]
    plan: dict[Phase, list[Bucket]] = {p: [] for p in Phase}
    for gi, g in enumerate(groups):
        plan[g.phase] += list(state(gi, ks[gi])[1])
    return {p: sorted(set(b)) for p, b in plan.items()}


def _or_unbounded(max_num_batched_tokens: int | None) -> int:
    """The step's token budget, or no bound where the document does not say."""
    return 1 << 62 if max_num_batched_tokens is None else max_num_batched_tokens


def format_bucket_file(plan: Mapping[Phase, Sequence[Bucket]], header: str = "") -> str:
    """``VLLM_BUCKETING_FROM_FILE`` text: one line per (bs, ctx) of prompts and per bs of
    decodes, the other dimension as a list (``server.hpu.buckets.plan.parse_bucket_file``)."""
    lines = [f"# {h}" for h in header.splitlines()]
    rows: dict[tuple[int, int], list[int]] = {}
    for bs, q, ctx in plan.get(Phase.PREFILL, ()):
        rows.setdefault((bs, ctx), []).append(q)
    lines.append("# prompt buckets (bs, query tokens, context blocks)")
    lines += [f"({bs}, {sorted(qs)}, {ctx})" for (bs, ctx), qs in sorted(rows.items())]
    dec: dict[int, list[int]] = {}
    for bs, _, blocks in plan.get(Phase.DECODE, ()):
        dec.setdefault(bs, []).append(blocks)
    lines.append("# decode buckets (bs, 1, total KV blocks)")
    lines += [f"({bs}, 1, {sorted(bl)})" for bs, bl in sorted(dec.items())]
    return "\n".join(lines) + "\n"
