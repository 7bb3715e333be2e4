"""The scheduling core: sequences, the KV block manager and the scheduler (pure Python).

Decides which sequences run in each step and which KV blocks they hold. Imports nothing of
the engine around it (the worker, the executors, the front end): only the leaf types of
``server.engine.outputs`` / ``sampling_params`` / ``errors``, the config and
``server.hpu.types``.
"""
