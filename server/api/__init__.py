"""OpenAI-compatible HTTP front end (FastAPI). Knows nothing of tensors."""
