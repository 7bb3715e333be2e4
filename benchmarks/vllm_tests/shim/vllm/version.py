"""vLLM's version, for the tests' ``/version`` check: here the version of hpu-serve under test."""

import os
import sys

sys.path.insert(0, os.environ["HPU_SERVE_ROOT"])

import server  # noqa: E402  (lazy: no torch)

__version__: str = server.__version__
