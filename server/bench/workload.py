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


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """Shape of a random workload (vLLM's ``random`` dataset semantics)."""

    num_prompts: int
    input_len: int = 200
    output_len: int = 128
    # lengths are drawn uniformly from [len * (1 - ratio), len * (1 + ratio)]
    range_ratio: float = 0.0
    seed: int = 0


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
    requests = []
    for _ in range(spec.num_prompts):
        in_len = _length(rng, spec.input_len, spec.range_ratio)
        out_len = _length(rng, spec.output_len, spec.range_ratio)
        text, actual = _prompt_of_length(rng, tokenizer, in_len, special)
        requests.append(BenchRequest(text, actual, out_len))
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
