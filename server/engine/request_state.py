"""A request as the front end holds it between steps: its sequences, their detokenizers and
what the current step added (a leaf type: the input processor builds it, the output processor
updates it, the engine hands it between them)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from server.engine.core.sequence import Sequence
from server.engine.detokenizer import IncrementalDetokenizer
from server.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
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

    @property
    def finished(self) -> bool:
        return all(d.finished for d in self.deltas)

    def take_output(self) -> RequestOutput:
        """This step's output. The caller owns it: later steps write to new deltas (the
        finish state carries over), so nothing is copied, whatever the output's length."""
        out = RequestOutput(
            self.request_id, self.prompt, self.prompt_token_ids, self.deltas, self.finished,
            replace(self.metrics), sum(s.num_output_tokens for s in self.seqs),
        )
        self.deltas = [
            CompletionOutput(d.index, logprobs=None if d.logprobs is None else [],
                             finish_reason=d.finish_reason, stop_reason=d.stop_reason)
            for d in self.deltas
        ]
        return out
