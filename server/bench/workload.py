"""Reproducible synthetic workloads: seeded prompts of a chosen token length distribution."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol


class TextTokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request of the workload: text prompt, its token count, tokens to generate."""

    prompt: str
    prompt_len: int
    output_len: int
    # multi-turn workloads: the conversation this turn belongs to (turns of one run in
    # order, each resending the history with the answers the server gave); None: alone
    conversation: int | None = None
    turn: int = 0


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """Shape of a random workload (vLLM's ``random`` dataset semantics)."""

    num_prompts: int
    input_len: int = 200
    output_len: int = 128
    # lengths are drawn uniformly from [len * (1 - ratio), len * (1 + ratio)]
    range_ratio: float = 0.0
    seed: int = 0
    # every prompt starts with the same this-many-token prefix (a shared system prompt),
    # followed by its own input_len tokens: what prefix caching saves
    shared_prefix_len: int = 0
    # this fraction of the prompts has long_input_len tokens instead (a long-prompt mix)
    long_fraction: float = 0.0
    long_input_len: int = 4096
    # each of the num_prompts prompts opens a conversation of this many user turns
    turns: int = 1

    def __post_init__(self) -> None:
        if self.shared_prefix_len < 0 or self.long_input_len < 1:
            raise ValueError("--shared-prefix-len must be >= 0, --long-input-len >= 1")
        if not 0.0 <= self.long_fraction <= 1.0:
            raise ValueError("--long-prompt-fraction must be in [0, 1]")
        if self.turns < 1:
            raise ValueError("--turns must be >= 1")


def _length(rng: random.Random, mean: int, ratio: float) -> int:
    low, high = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return rng.randint(low, high)


def _prompt_of_length(rng: random.Random, tokenizer: TextTokenizer, length: int,
                      special: set[int]) -> tuple[str, int]:
    """Random-token text that re-tokenises to ``length`` tokens (or the closest found).

    Decoding random ids and encoding the text again merges or splits tokens, so the ids are
    trimmed or extended until the round trip lands on the target.
    """
    ids = [rng.randrange(tokenizer.vocab_size) for _ in range(length)]
    ids = [i if i not in special else (i + 1) % tokenizer.vocab_size for i in ids]
    best_text, best_len = "", -1
    for _ in range(8):
        text = tokenizer.decode(ids)
        n = len(tokenizer.encode(text, add_special_tokens=False))
        if best_len < 0 or abs(n - length) < abs(best_len - length):
            best_text, best_len = text, n
        if n == length:
            break
        if n > length:
            ids = ids[: max(1, len(ids) - (n - length))]
        else:
            ids = ids + [rng.randrange(tokenizer.vocab_size) for _ in range(length - n)]
            ids = [i if i not in special else (i + 1) % tokenizer.vocab_size for i in ids]
    return best_text, best_len


def synthetic_requests(spec: WorkloadSpec, tokenizer: TextTokenizer,
                       special_ids: set[int] | None = None) -> list[BenchRequest]:
    """The same list for the same spec and tokenizer, on every machine."""
    rng = random.Random(spec.seed)
    special = set(special_ids or ())
    prefix = ""
    if spec.shared_prefix_len:
        prefix, _ = _prompt_of_length(random.Random(spec.seed - 1), tokenizer,
                                      spec.shared_prefix_len, special)
        prefix += "\n"  # a boundary tokenizers do not merge across
    # which prompts are long: an exact count, spread by the seed
    num_long = round(spec.num_prompts * spec.long_fraction)
    long = set(random.Random(spec.seed + 2).sample(range(spec.num_prompts), num_long))
    requests = []
    for i in range(spec.num_prompts):
        mean = spec.long_input_len if i in long else spec.input_len
        in_len = _length(rng, mean, spec.range_ratio)
        out_len = _length(rng, spec.output_len, spec.range_ratio)
        text, actual = _prompt_of_length(rng, tokenizer, in_len, special)
        if prefix:
            text = prefix + text
            actual = len(tokenizer.encode(text, add_special_tokens=False))
        if spec.turns == 1:
            requests.append(BenchRequest(text, actual, out_len))
            continue
        requests.append(BenchRequest(text, actual, out_len, conversation=i, turn=0))
        for turn in range(1, spec.turns):  # follow-ups: new user text of input_len tokens
            more, more_len = _prompt_of_length(rng, tokenizer, in_len, special)
            requests.append(BenchRequest(more, more_len, out_len, conversation=i, turn=turn))
    return requests


def arrival_gaps(rate: float, count: int, seed: int, burstiness: float = 1.0) -> Iterator[float]:
    """Seconds to wait before each request: all at once for an infinite rate, otherwise
    gamma-distributed gaps with mean 1/rate (burstiness 1 = a Poisson process)."""
    rng = random.Random(seed + 1)
    for _ in range(count):
        if rate == float("inf"):
            yield 0.0
        else:
            yield rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
