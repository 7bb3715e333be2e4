"""``import habana_frameworks.torch``: loads the bridge. Like the real one, this makes
``torch.hpu`` available and registers the ``hpu_backend`` compiler with dynamo."""

from __future__ import annotations

import os as _os

import torch as _torch

from habana_frameworks import standin as _standin
from habana_frameworks.torch import core, dynamo, hpu  # noqa: F401 - what the bridge exposes

_torch.hpu = hpu  # type: ignore[attr-defined]
# The bridge reads its configuration from the environment when it loads: record what it saw.
_standin.CALLS.append(_standin.Call("bridge.load", {
    name: _os.environ.get(name)
    for name in ("PT_HPU_LAZY_MODE", "PT_HPU_RECIPE_CACHE_CONFIG", "HABANA_VISIBLE_DEVICES")}))
