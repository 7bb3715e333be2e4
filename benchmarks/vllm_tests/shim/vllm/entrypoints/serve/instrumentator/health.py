"""vLLM's health handler, for collection only (its unit test is not applicable)."""


async def health(request: object) -> object:
    raise NotImplementedError("vLLM's health handler: a vLLM internal, not applicable")
