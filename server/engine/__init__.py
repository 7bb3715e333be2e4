"""Engine core: request lifecycle from prompt to outputs.

Owns: sampling params, input and output processing, the scheduler and KV block bookkeeping
(pure Python), the model runner (the model's device resources and one step on them), the
sampler, tokenizer / detokenizer, the synchronous ``LLMEngine``, the threaded ``AsyncEngine``
and the offline ``LLM``.
May import: ``server.models``, ``server.hpu``, ``server.config``. Never HTTP.
"""
