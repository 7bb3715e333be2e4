"""Speculative verify: target logits at every draft position -> the accepted run.

Each sequence with ``k`` drafts has ``k + 1`` verify rows: row ``j`` scores the token after
the last one plus drafts ``[:j]``. Every row goes through the logit processors as the
sequence would be at that position (penalties and bad words see the drafts before it as
generated, ``min_tokens`` counts them), so its distribution ``p_j`` is the one plain
decoding would sample from. Draft ``j`` is a point mass (n-gram lookup), so the standard
rule reduces to: accept it with probability ``p_j(draft)``; on rejection draw from ``p_j``
with the draft removed, renormalised, and stop; after ``k`` acceptances draw the bonus
token from ``p_k``. Greedy rows accept while the draft is the argmax and end with the
argmax: the same tokens as plain greedy decoding.
"""

from __future__ import annotations

import dataclasses

import torch

from server.engine.core.sequence import Sequence
from server.engine.outputs import TokenLogprob
from server.engine.worker.sampler import (
    Sampler,
    SamplingTensors,
    _generator,
    inverse_cdf_sample,
    sampling_probs,
    to_token_logprobs,
    with_logprobs,
)


def verify_rows(seqs: list[Sequence], drafts: list[list[int]],
                device: torch.device) -> list[Sequence]:
    """The stand-in sequences of the verify rows: row ``j`` of a sequence has its drafts
    ``[:j]`` as output already (sharing its parameters, grammar and seeded generator)."""
    rows: list[Sequence] = []
    for seq, extra in zip(seqs, drafts):
        _generator(seq, device)  # created on the real sequence: the rows share it
        rows.append(seq)
        for j in range(1, len(extra) + 1):
            rows.append(dataclasses.replace(
                seq, output_token_ids=seq.output_token_ids + extra[:j]))
    return rows


def verify(sampler: Sampler, logits: torch.Tensor, seqs: list[Sequence],
           drafts: list[list[int]], rows: list[Sequence], t: SamplingTensors
           ) -> tuple[list[list[int]], list[list[TokenLogprob | None]]]:
    """``logits`` ``[R, V]`` of the verify ``rows`` -> each sequence's run (accepted drafts,
    then one corrected or bonus token) and the target's logprobs of its tokens."""
    logits = sampler.process(logits, t)
    logprobs = torch.log_softmax(logits, dim=-1) if t.num_logprobs >= 0 else None
    greedy = sampler.argmax(logits)
    num_rows = logits.shape[0]
    nxt = [d for extra in drafts for d in extra + [0]]  # each row's draft (bonus rows: 0)
    draft_t = torch.tensor(nxt, dtype=torch.long, device=logits.device)
    if t.all_greedy:
        accept = (greedy == draft_t).tolist()
        fix = greedy
        bonus = greedy
    else:
        probs = sampling_probs(logits, t)
        probs = probs / probs.sum(dim=-1, keepdim=True)
        p_draft = probs.gather(1, draft_t.unsqueeze(1)).squeeze(1)
        uniform = torch.rand(num_rows, device=logits.device)
        for row, gen in enumerate(t.generators):
            if gen is not None:
                uniform[row] = torch.rand(1, generator=gen, device=logits.device)
        residual = probs.scatter(1, draft_t.unsqueeze(1), 0.0)
        fix = torch.where(t.is_greedy, greedy, inverse_cdf_sample(residual, t.generators))
        bonus = torch.where(t.is_greedy, greedy, inverse_cdf_sample(probs, t.generators))
        accept = torch.where(t.is_greedy, greedy == draft_t, uniform < p_draft).tolist()
    fix_l, bonus_l = fix.tolist(), bonus.tolist()
    runs: list[list[int]] = []
    used: list[int] = []  # the verify row each emitted token comes from
    chosen = [0] * num_rows
    base = 0
    for extra in drafts:
        run: list[int] = []
        for j, draft in enumerate(extra):
            row = base + j
            used.append(row)
            if accept[row]:
                run.append(draft)
                chosen[row] = draft
            else:
                run.append(fix_l[row])
                chosen[row] = fix_l[row]
                break
        else:
            row = base + len(extra)
            used.append(row)
            run.append(bonus_l[row])
            chosen[row] = bonus_l[row]
        runs.append(run)
        base += len(extra) + 1
    if logprobs is None:
        return runs, [[None] * len(run) for run in runs]
    out = with_logprobs(torch.tensor(chosen, device=logits.device), logprobs, t)
    per_row = to_token_logprobs(out, rows)
    flat = [per_row[row] for row in used]
    result: list[list[TokenLogprob | None]] = []
    at = 0
    for run in runs:
        result.append(flat[at:at + len(run)])
        at += len(run)
    return runs, result
