"""hpu-serve: an OpenAI-compatible LLM server with bucketed, graph-captured execution.

``from server import LLM, SamplingParams`` is the offline API. Imports are lazy so that
``import server`` (e.g. for the CLI's help) does not pull in torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "BeamSearchParams", "LoRARequest", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from server.engine.beam_search import BeamSearchParams
    from server.engine.llm import LLM
    from server.engine.lora.request import LoRARequest
    from server.engine.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from server.engine.llm import LLM

        return LLM
    if name == "BeamSearchParams":
        from server.engine.beam_search import BeamSearchParams

        return BeamSearchParams
    if name == "LoRARequest":
        from server.engine.lora.request import LoRARequest

        return LoRARequest
    if name == "SamplingParams":
        from server.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
