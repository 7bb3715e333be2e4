"""A request as the front end holds it between steps: its sequences, their detokenizers and
what the current step added (a leaf type: the input processor builds it, the output processor
updates it, the engine hands it between them)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from server.engine.core.sequence import Sequence
from server.engine.detokenizer import IncrementalDetokenizer
from server.engine.outputs import (
    CompletionOutput,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
    TokenLogprob,
)
from server.engine.sampling_params import SamplingParams


@dataclass(slots=True)
class RequestState:
    """A request's sequences and what this step added to each of its completions."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    detokenizers: list[IncrementalDetokenizer]
    # this step's delta per completion; handed out by take_output, then started afresh
    deltas: list[CompletionOutput]
    metrics: RequestMetrics
    # with prompt_logprobs: the prompt's so far ([None] for its first token), handed out
    # once whole
    prompt_logprobs: PromptLogprobs | None = None
    prompt_logprobs_sent: bool = False

    @property
    def finished(self) -> bool:
        return all(d.finished for d in self.deltas)

    def add_prompt_logprobs(self, first_token: int, entries: list[TokenLogprob]) -> None:
        """A step's scored prompt tokens from ``first_token`` on; tokens already scored
        (a prompt recomputed after a preemption) are kept as they were."""
        scored = self.prompt_logprobs
        if scored is None:
            return
        for index, entry in enumerate(entries, first_token):
            if index == len(scored):
                scored.append(entry)

    def take_output(self) -> RequestOutput:
        """This step's output. The caller owns it: later steps write to new deltas (the
        finish state carries over), so nothing is copied, whatever the output's length."""
        out = RequestOutput(
            self.request_id, self.prompt, self.prompt_token_ids, self.deltas, self.finished,
            replace(self.metrics), sum(s.num_output_tokens for s in self.seqs),
        )
        if (self.prompt_logprobs is not None and not self.prompt_logprobs_sent
                and len(self.prompt_logprobs) == len(self.prompt_token_ids)):
            out.prompt_logprobs = self.prompt_logprobs
            self.prompt_logprobs_sent = True
        self.deltas = [
            CompletionOutput(d.index, logprobs=None if d.logprobs is None else [],
                             finish_reason=d.finish_reason, stop_reason=d.stop_reason)
            for d in self.deltas
        ]
        return out
