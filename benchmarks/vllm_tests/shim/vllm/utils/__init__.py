"""vLLM's utility modules the tests import."""
