"""Beam search as vLLM v1 runs it: in front of the engine, one step at a time.

Each step every live beam is sent to the engine as a prompt of its own (its prompt plus the
tokens it has so far) asking for one token with the ``2 * beam_width`` most likely next
tokens' logprobs; beams share their prompt's KV blocks through the prefix cache. The
candidates of all beams are ranked by ``cumulative logprob / length ** length_penalty``
(the length counts the prompt, EOS excluded, as vLLM scores); a candidate ending in EOS
becomes a finished hypothesis, the best ``beam_width`` others are the next step's beams.
After ``max_tokens`` steps (or once no beam is left, or with ``early_stopping`` once
``beam_width`` hypotheses have finished) the best ``beam_width`` of the finished and live
beams are the answer, best first.

Torch-free: the server's front end and the offline ``LLM`` drive it, each with its own way of
running the expansions (``expansion_params``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

from server.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from server.engine.sampling_params import MAX_LOGPROBS, SamplingParams

# candidates read per beam and step (vLLM's): enough that beam_width survive EOS endings
CANDIDATES_PER_BEAM = 2
MAX_BEAM_WIDTH = MAX_LOGPROBS // CANDIDATES_PER_BEAM


class BeamSearchParams(BaseModel):
    """vLLM's ``BeamSearchParams`` (``LLM.beam_search``; ``use_beam_search`` on the API)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    beam_width: int = Field(ge=1, le=MAX_BEAM_WIDTH, description="beams kept per step; also "
                            "the number of answers")
    max_tokens: int = Field(ge=1, description="steps (tokens per beam)")
    ignore_eos: bool = False
    temperature: float = Field(0.0, ge=0.0, description="accepted as vLLM takes it: the "
                               "candidates are ranked by the model's logprobs either way")
    length_penalty: float = 1.0
    # HF's early_stopping=True: stop once beam_width hypotheses have finished (vLLM accepts
    # the field; off, every step runs, as vLLM v1 does)
    early_stopping: bool = False
    include_stop_str_in_output: bool = False


@dataclass(slots=True)
class Beam:
    """One hypothesis: its generated tokens (no prompt), their logprobs, its score's sum."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    cum_logprob: float = 0.0
    finished: bool = False  # ended with EOS (the last token)


def beam_score(length: int, cum_logprob: float, length_penalty: float) -> float:
    """vLLM's ``get_beam_search_score``: ``length`` counts the prompt, not a final EOS."""
    return cum_logprob / (max(length, 1) ** length_penalty)


class BeamSearch:
    """The state of one prompt's beam search; ``pending`` beams wait for their candidates."""

    def __init__(self, prompt_token_ids: Sequence[int], params: BeamSearchParams,
                 eos_token_id: int | None, max_model_len: int | None = None) -> None:
        self.prompt = list(prompt_token_ids)
        # a beam never grows past the context (max_tokens may be the context's worth)
        self.max_steps = params.max_tokens if max_model_len is None else min(
            params.max_tokens, max_model_len - len(self.prompt))
        self.params = params
        self.eos = None if params.ignore_eos else eos_token_id
        self.beams: list[Beam] = [Beam()]
        self.finished: list[Beam] = []
        self.steps = 0

    def expansion_params(self) -> SamplingParams:
        """What each beam's engine request asks: one token, the candidates' logprobs."""
        return SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True,
                              logprobs=CANDIDATES_PER_BEAM * self.params.beam_width)

    @property
    def done(self) -> bool:
        p = self.params
        return (self.steps >= self.max_steps or not self.beams
                or (p.early_stopping and len(self.finished) >= p.beam_width))

    def pending(self) -> list[list[int]]:
        """Each live beam's whole sequence: the prompts of this step's expansions."""
        return [self.prompt + beam.tokens for beam in self.beams]

    def _score(self, beam: Beam) -> float:
        length = len(self.prompt) + len(beam.tokens) - (1 if beam.finished else 0)
        return beam_score(length, beam.cum_logprob, self.params.length_penalty)

    def advance(self, candidates: Sequence[TokenLogprob]) -> None:
        """One step: ``candidates[i]`` is beam i's expansion (its ``top`` the most likely
        next tokens with their logprobs)."""
        assert len(candidates) == len(self.beams), "one expansion per live beam"
        grown: list[Beam] = []
        for beam, expansion in zip(self.beams, candidates):
            for token_id, logprob in expansion.top:
                entry = TokenLogprob(token_id, logprob, list(expansion.top))
                child = Beam(beam.tokens + [token_id], beam.logprobs + [entry],
                             beam.cum_logprob + logprob, finished=token_id == self.eos)
                (self.finished if child.finished else grown).append(child)
        # sorted() is stable: equal scores keep the beams' order, then the candidates' rank
        self.beams = sorted(grown, key=self._score, reverse=True)[:self.params.beam_width]
        self.steps += 1

    def best(self) -> list[Beam]:
        """The answer: the best ``beam_width`` of the finished and live beams, best first."""
        ranked = sorted(self.finished + self.beams, key=self._score, reverse=True)
        return ranked[:self.params.beam_width]

    def output(self, request_id: str, decode: Callable[[list[int]], str],
               logprobs: int | None = None) -> RequestOutput:
        """The finished request: one completion per beam, best first (index = rank). A
        final EOS is left out of the text (and of the tokens unless
        ``include_stop_str_in_output``), as vLLM writes it. ``logprobs``: each token's with
        that many alternatives (None: none)."""
        outputs = []
        for rank, beam in enumerate(self.best()):
            text_tokens = beam.tokens[:-1] if beam.finished else beam.tokens
            kept = len(beam.tokens if self.params.include_stop_str_in_output else text_tokens)
            outputs.append(CompletionOutput(
                rank, decode(text_tokens), beam.tokens[:kept],
                None if logprobs is None else [
                    TokenLogprob(e.token_id, e.logprob, e.top[:logprobs])
                    for e in beam.logprobs[:kept]],
                "stop" if beam.finished else "length",
                beam.tokens[-1] if beam.finished else None))
        generated = sum(len(o.token_ids) for o in outputs)
        return RequestOutput(request_id, None, list(self.prompt), outputs, finished=True,
                             num_generated_tokens=generated)
