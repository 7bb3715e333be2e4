"""``habana_frameworks.torch.dynamo``: registers the ``hpu_backend`` compiler for
``torch.compile`` (eager mode, ``PT_HPU_LAZY_MODE=0``)."""

from __future__ import annotations

from typing import Any

import torch
from torch._dynamo.backends import registry

from habana_frameworks import standin


def _reference_backend(graph_module, example_inputs, **kwargs):  # noqa: ANN001, ANN202
    ...


@standin.documented("dynamo.hpu_backend", _reference_backend)
def hpu_backend(graph_module: torch.fx.GraphModule, example_inputs: list[torch.Tensor],
                **kwargs: Any) -> Any:
    """Dynamo hands each new graph (one per new input shape with ``dynamic=False``) to the
    backend: one compilation each; the stand-in runs the captured graph eagerly."""
    standin.compiled()
    return graph_module.forward


# Tests load the stand-in afresh (a new device each time): the newest one is the backend.
registry._COMPILER_FNS.pop("hpu_backend", None)
registry.register_backend(hpu_backend)
