"""Prompt logprobs (vLLM's ``prompt_logprobs``): the logprob of each prompt token given the
ones before it, with its rank and the top k, from the same forward that fills the KV cache.

A step holding such a prompt chunk asks the forward for the logits of every token of its
padded grid rather than of each row's last token: the decoder layers run the bucket's
planned shape unchanged (the compiled or captured layers see nothing new), and only the LM
head, which runs outside the compiled layers, takes more rows. Steps without such a chunk
are untouched. Logits are the model's raw ones (no penalties, bias or masks), as vLLM's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from server.engine.core.sequence import Sequence
from server.engine.outputs import TokenLogprob
from server.hpu.graph_runner import ForwardInputs


@dataclass(frozen=True, slots=True)
class ScoredChunk:
    """One row's prompt tokens scored this step."""

    row: int
    first_token: int  # index in the prompt of the first token scored (>= 1)
    count: int  # tokens scored: position p's logits score token p + 1


def scored_chunks(seqs: Seq[Sequence], new_tokens: Seq[int]) -> list[ScoredChunk]:
    """The rows whose chunk scores prompt tokens. Only a request's first completion scores
    them (its n completions share the prompt); positions past the prompt (recomputed
    output after a preemption) score nothing."""
    chunks = []
    for row, (seq, n) in enumerate(zip(seqs, new_tokens)):
        if seq.params.prompt_logprobs is None or seq.index != 0:
            continue
        start = seq.num_computed_tokens
        count = min(start + n, seq.num_prompt_tokens - 1) - start
        if count > 0:
            chunks.append(ScoredChunk(row, start + 1, count))
    return chunks


def all_rows(inputs: ForwardInputs) -> tuple[ForwardInputs, torch.Tensor]:
    """The same inputs asking for the logits of every token of the grid, and the flat
    indices of the rows' last tokens (the logits the sampler takes)."""
    every = torch.arange(inputs.input_ids.numel(), device=inputs.logits_indices.device)
    widened = dataclasses.replace(inputs, logits_indices=every)  # LoRA slots too
    return widened, inputs.logits_indices


def flat_starts(inputs: ForwardInputs, new_tokens: Seq[int], packed: bool) -> list[int]:
    """Where each row's first new token sits in the flattened grid."""
    if packed:  # back to back in one row
        starts, at = [], 0
        for n in new_tokens:
            starts.append(at)
            at += n
        return starts
    width = inputs.input_ids.shape[1]
    return [row * width for row in range(len(new_tokens))]


def score(logits: torch.Tensor, chunks: Seq[ScoredChunk], starts: Seq[int],
          seqs: Seq[Sequence]) -> dict[str, tuple[int, list[TokenLogprob]]]:
    """Each chunk's prompt tokens scored from ``logits`` (every token of the grid): request
    id -> (index of the first token scored, its entries)."""
    result: dict[str, tuple[int, list[TokenLogprob]]] = {}
    vocab = logits.shape[-1]
    for chunk in chunks:
        seq = seqs[chunk.row]
        start = starts[chunk.row]
        rows = logits[start : start + chunk.count].float()
        logprobs = torch.log_softmax(rows, dim=-1)
        targets = torch.tensor(
            seq.prompt_token_ids[chunk.first_token : chunk.first_token + chunk.count],
            device=logprobs.device)
        chosen = logprobs.gather(1, targets.unsqueeze(1))
        ranks = (logprobs > chosen).sum(dim=-1) + 1
        k = min(seq.params.prompt_logprobs or 0, vocab)
        top_lps, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)
        chosen_l = chosen.squeeze(1).tolist()
        ranks_l = ranks.tolist()
        ids_l = top_ids.tolist() if top_ids is not None else [[]] * chunk.count
        lps_l = top_lps.tolist() if top_lps is not None else [[]] * chunk.count
        result[seq.request_id] = (chunk.first_token, [
            TokenLogprob(token, lp, list(zip(ids, lps)), rank)
            for token, lp, rank, ids, lps in zip(targets.tolist(), chosen_l, ranks_l, ids_l,
                                                 lps_l)])
    return result
