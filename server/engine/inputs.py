"""A request's input as the front end hands it to the engine: the prompt and its params, or
a builder of them that the engine runs, with its own checks, as one job off the event loop.

A leaf module (no torch): the API imports it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from server.engine.pooling.params import PoolingParams
from server.engine.sampling_params import SamplingParams

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class PromptInput:
    """A prompt (text, or token ids) and the params it is generated (or pooled) with."""

    prompt: str | list[int]
    params: SamplingParams | PoolingParams
    # the prompt's images (PIL images), one per image placeholder token, in order
    images: tuple[Any, ...] = ()


# Renders a chat template, tokenizes text...: whatever turns a request into its prompt costs
# time that grows with the input, so it runs where the engine tokenizes and validates.
PromptBuilder = Callable[[], PromptInput]


class Offload(Protocol):
    """Runs a blocking job off the event loop (the API's preprocess pool, in the client's
    share; ``asyncio.to_thread`` by default)."""

    def __call__(self, fn: Callable[[], T], /) -> Awaitable[T]: ...
