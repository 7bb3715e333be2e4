"""The engine: a request's life from prompt to outputs, by role.

- ``core/``: scheduler, KV block manager, sequences (pure Python);
- ``worker/``: model runner, input builder, sampler (one step on the device);
- ``executor/``: the tensor-parallel ranks (``base``, ``mp``, ``ray``);
- ``structured_outputs/``: grammar limits, compile workers, token masks;
- here, the front end: ``LLMEngine`` (``step = schedule -> run -> process``), the threaded
  ``AsyncEngine``, the offline ``LLM``, the input and output processors, tokenizer and
  detokenizer, and the leaf types that cross the step (``outputs``, ``request_state``,
  ``sampling_params``, ``errors``).

May import ``server.models``, ``server.hpu`` and ``server.config``; never HTTP.
"""
