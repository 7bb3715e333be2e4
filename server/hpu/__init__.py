"""Device layer: platform detection, paged attention ops and KV cache tensors.

Knows nothing of HTTP or of the engine's request types.
"""
