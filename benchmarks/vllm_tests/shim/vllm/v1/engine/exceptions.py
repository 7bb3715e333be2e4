class EngineDeadError(Exception):
    """vLLM's engine-dead error, for collection only."""
