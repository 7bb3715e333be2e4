"""vLLM's request model, for collection only (its unit tests are not applicable)."""


class ChatCompletionRequest:
    def __init__(self, *args: object, **kwargs: object) -> None:
        raise NotImplementedError("vLLM's ChatCompletionRequest: a vLLM internal, not applicable")
