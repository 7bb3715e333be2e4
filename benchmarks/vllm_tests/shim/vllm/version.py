"""vLLM's version, for the tests' ``/version`` check: here the version of hpu-serve under test."""

import os
import sys

sys.path.insert(0, os.environ["HPU_SERVE_ROOT"])

import server  # noqa: E402  (lazy: no torch)

__version__: str = server.__version__


def _prev_minor_version() -> str:
    """The minor version before this one (vLLM's tests pass it to
    --show-hidden-metrics-for-version, which hpu-serve accepts and ignores)."""
    major, minor = (int(part) for part in __version__.split(".")[:2])
    return f"{major}.{max(minor - 1, 0)}"
