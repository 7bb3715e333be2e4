"""The pooling runner: embeddings, scores and classes from one forward pass, no decode phase
and no KV cache. ``params`` and ``outputs`` are leaf modules (no torch) the API imports."""
