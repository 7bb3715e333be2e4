"""``hpu-serve bench``: a serving benchmark for any OpenAI-compatible endpoint.

Talks to servers only over HTTP; may import ``server.engine.tokenizer`` (to size prompts in
a model's tokens) and ``server.models.loader`` (to find a model's tokenizer files).
"""
