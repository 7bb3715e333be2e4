"""Device layer: platforms, graph runners, bucketing and warmup, paged attention, KV cache
tensors, and each platform's backend (``cpu/``, ``cuda.py``, ``gaudi.py``).

Owns: everything that depends on the device. May import: ``server.config`` and itself.
Knows nothing of HTTP, requests, sequences or models' weights formats.
"""
