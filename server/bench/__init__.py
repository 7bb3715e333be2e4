"""``hpu-serve bench``: a serving benchmark for any OpenAI-compatible endpoint."""
