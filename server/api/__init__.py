"""OpenAI-compatible HTTP front end (FastAPI + uvicorn).

Owns: the wire schemas, routes, errors, middleware, SSE streaming and the HTTP server.
May import: ``server.engine`` (through the ``EngineClient`` protocol and the engine's plain
request / output types), ``server.config``, ``server.metrics``. Knows nothing of tensors.
"""
