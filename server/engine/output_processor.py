"""After each step: append sampled tokens, detokenize, apply stop rules, build outputs."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from server.engine.core.sequence import ScheduledBatch, Sequence
from server.engine.outputs import (
    ModelRunnerOutput,
    RequestOutput,
    TokenLogprob,
)
from server.engine.request_state import RequestState
from server.engine.sampling_params import SamplingParams
from server.engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ProcessedStep:
    """A step's outputs, and what the scheduler must retire because of it."""

    outputs: list[RequestOutput]
    finished: list[Sequence]  # sequences that stopped this step
    failed: list[str]  # requests whose processing raised (already answered with an error)


class OutputProcessor:
    """Applies one step's sampled tokens to the requests and retires finished sequences."""

    def __init__(self, tokenizer: Tokenizer, eos_token_ids: frozenset[int], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.requests: dict[str, RequestState] = {}

    def add(self, state: RequestState) -> None:
        self.requests[state.request_id] = state

    def process(self, batch: ScheduledBatch, result: ModelRunnerOutput) -> ProcessedStep:
        now = time.monotonic()
        touched: dict[str, RequestState] = {}
        failed: dict[str, BaseException] = {}
        finished: list[Sequence] = []
        for request_id, (first_token, entries) in result.prompt_logprobs.items():
            scoring = self.requests.get(request_id)
            if scoring is not None:
                scoring.add_prompt_logprobs(first_token, entries)
        runs = result.runs or [[t] for t in result.token_ids]
        run_logprobs = result.run_logprobs or [[lp] for lp in result.logprobs]
        for seq, run, logprobs in zip(batch.seqs, runs, run_logprobs):
            if seq.request_id in failed:
                continue
            state = self.requests[seq.request_id]
            if seq.request_id not in touched:
                touched[seq.request_id] = state
                state.metrics.last_token_time = now
                if state.metrics.first_token_time is None:
                    state.metrics.first_token_time = now
            try:
                # a verify step's run: a stop (EOS, stop string, length) inside it cuts the
                # tokens after it
                for token_id, logprob in zip(run, logprobs):
                    self._append(state, seq, token_id, logprob)
                    if seq.finish_reason is not None:
                        break
            except Exception as exc:  # this request's own fault: the others go on
                failed[seq.request_id] = exc
                continue
            if seq.finish_reason is not None:
                finished.append(seq)
        outputs = []
        for request_id, exc in failed.items():
            del touched[request_id]
            failure = self.fail(request_id, exc)
            if failure is not None:
                outputs.append(failure)
        for state in touched.values():
            if state.finished:
                state.metrics.finished_time = now
                del self.requests[state.request_id]
            outputs.append(state.take_output())
        return ProcessedStep(outputs, finished, list(failed))

    def abort(self, request_id: str) -> RequestOutput | None:
        """Marks every unfinished sequence of a request aborted; returns its last output."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return None
        for delta in state.deltas:
            if not delta.finished:
                delta.finish_reason = "abort"
        state.metrics.finished_time = time.monotonic()
        return state.take_output()

    def fail(self, request_id: str, exc: BaseException) -> RequestOutput | None:
        """Ends a request whose own processing raised (the caller frees its sequences):
        logged with the traceback, its last output carries the error."""
        logger.error("request %s failed and was stopped: %r", request_id, exc, exc_info=exc)
        output = self.abort(request_id)
        if output is not None:
            output.error = f"{type(exc).__name__}: {exc}"
        return output

    def _append(
        self, state: RequestState, seq: Sequence, token_id: int, logprob: TokenLogprob | None
    ) -> None:
        params = state.params
        delta = state.deltas[seq.index]
        seq.output_token_ids.append(token_id)
        delta.token_ids.append(token_id)
        if logprob is not None and delta.logprobs is not None:
            delta.logprobs.append(logprob)
        detok = state.detokenizers[seq.index]
        reason, stop_reason = self._stop_by_token(seq, token_id, params)
        if seq.grammar is not None and self._grammar_done(seq, token_id) and reason is None:
            reason = "stop"  # the constraint is complete: nothing more may follow
        text = ""
        if reason is None:
            # EOS / stop token ids never reach the text.
            update = detok.update([token_id])
            text = update.delta_text
            if update.stop_string is not None:
                reason, stop_reason = "stop", update.stop_string
        if reason is None and self._at_length_limit(seq, params):
            reason = "length"
        if reason is not None:
            text += detok.flush()  # text held back in case it began a stop string
            seq.finish_reason = delta.finish_reason = reason
            seq.stop_reason = delta.stop_reason = stop_reason
        delta.text += text

    @staticmethod
    def _grammar_done(seq: Sequence, token_id: int) -> bool:
        """Advances the sequence's matcher; True once the grammar has ended."""
        grammar = seq.grammar
        if grammar.active and not grammar.terminated:
            if not grammar.matcher.accept_token(token_id):
                raise ValueError(f"token {token_id} is not allowed by the request's grammar")
        grammar.observe(seq.output_token_ids)
        return grammar.active and grammar.terminated

    def _stop_by_token(
        self, seq: Sequence, token_id: int, params: SamplingParams
    ) -> tuple[str | None, int | None]:
        if seq.num_output_tokens < params.min_tokens:
            return None, None
        if not params.ignore_eos and token_id in self.eos_token_ids:
            return "stop", None
        if token_id in params.stop_token_ids:
            return "stop", token_id
        return None, None

    def _at_length_limit(self, seq: Sequence, params: SamplingParams) -> bool:
        if params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens:
            return True
        return seq.num_tokens >= self.max_model_len

