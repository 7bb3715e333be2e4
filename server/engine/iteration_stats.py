"""vLLM's ``vllm:iteration_tokens_total``: the tokens of each engine step (prompts that got
their first token, plus tokens sampled), one observation per ``LLMEngine.step()``."""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Histogram

from server.engine.core.sequence import ScheduledBatch
from server.hpu.types import Phase


def _buckets(max_tokens: int) -> tuple[int, ...]:
    """1, 8, 16, 32... up to the step's token budget, as vLLM's boundaries run."""
    out, edge = [1], 8
    while edge < max_tokens:
        out.append(edge)
        edge *= 2
    return (*out, max_tokens)


class IterationTokens:
    """Observes each step's tokens into the engine's registry (folded into /metrics)."""

    def __init__(self, model_name: str, registry: CollectorRegistry,
                 max_num_batched_tokens: int) -> None:
        self._hist = Histogram(
            "vllm:iteration_tokens_total", "Tokens per engine step: the prompts that got their "
            "first token plus the tokens generated.", ["model_name"],
            buckets=_buckets(max(max_num_batched_tokens, 8)),
            registry=registry).labels(model_name)

    @staticmethod
    def tokens(batch: ScheduledBatch) -> int:
        """A batch's share, counted before it runs (running advances its sequences), as
        vLLM counts: one per token sampled, plus a prompt's whole length at the step that
        samples its first token (prefix-cached and earlier-chunk tokens included, a
        preempted sequence's recompute not again)."""
        rows = batch.sampling_rows
        prompts = 0
        if batch.phase is Phase.PREFILL:
            prompts = sum(len(batch.seqs[row].prompt_token_ids) for row in rows
                          if not batch.seqs[row].output_token_ids)
        return prompts + len(rows)

    def observe(self, counts: Sequence[int]) -> None:
        """One step's batches; a step that ran none (every request had ended) is no
        iteration. A step running only a prompt's middle chunk counts, as 0 (as in vLLM)."""
        if counts:
            self._hist.observe(sum(counts))
