"""The real server on the Gaudi stand-in (tests only): ``python tests/standin_server.py serve
--device hpu ...`` behaves as ``python -m server serve`` on a Gaudi, except that the bridge
is ``tests/fakes/habana_frameworks`` and tensors stay on the CPU (the stand-in cannot give
torch an "hpu" device). ``HABANA_STANDIN_RECORD=path`` makes the stand-in write its recorded
calls there at exit."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "fakes"))

from server.cli import main  # noqa: E402
from server.hpu import gaudi  # noqa: E402


def cpu_backed_hpu_plugin() -> gaudi.HpuPlatform | None:
    return gaudi.HpuPlatform(torch.device("cpu")) if gaudi._hpu_available() else None


gaudi.hpu_plugin = cpu_backed_hpu_plugin  # type: ignore[assignment]

if __name__ == "__main__":
    sys.exit(main())
