"""A stand-in for Intel Gaudi's PyTorch bridge (``habana_frameworks``), for tests only.

The bridge is not on PyPI and no CI machine has a Gaudi, so without this the server's HPU
code paths would first run on a customer's card. This package provides the modules and
functions the server calls, each one

- checking its arguments against the bridge's documented signature (a wrong call raises the
  ``TypeError`` the real one would),
- recording the call (``habana_frameworks.standin.CALLS``), so tests can prove which paths ran,
- doing the equivalent CPU work: tensors stay on the CPU, an "HPU graph" is the wrapped module
  run eagerly with the bridge's capture and replay semantics, a compilation is counted the
  first time a shape is run.

Written from the bridge's public sources (HabanaAI/gaudi-pytorch-bridge,
``python_packages/habana_frameworks/torch/``: ``hpu/graphs.py`` for ``wrap_in_hpu_graph``,
its input hashing, ``bypass_hpu_graphs`` and replay-by-copy; ``core/__init__.py`` for
``mark_step``; ``hpu/memory.py`` for ``mem_get_info`` / ``memory_stats``;
``hpu/metrics/metrics.py`` for ``metric_global("graph_compilation")``;
``dynamo/compile_backend/backends.py`` for the ``hpu_backend`` compiler) and from how public
projects call them (vllm-project/vllm-gaudi ``vllm_gaudi/v1/worker/hpu_model_runner.py``,
huggingface/optimum-habana). Never installed with the product: tests put ``tests/fakes`` on
``sys.path``.
"""
