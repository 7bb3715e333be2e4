"""The pooling endpoints (vLLM's): /v1/embeddings, /pooling, /classify, /score and /rerank,
served when the engine runs a pooling model (``--runner pooling``)."""
