"""vLLM's internals, for collection only (the unit tests using them are not applicable)."""


class SamplingParams:
    def __init__(self, *args: object, **kwargs: object) -> None:
        raise NotImplementedError("vLLM's SamplingParams: a vLLM internal, not applicable")
