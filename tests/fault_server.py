"""The real server with a fault injected into the model runner (tests only).

``python tests/fault_server.py serve MODEL ...`` behaves as ``python -m server serve`` except
that, per ``HPU_SERVE_TEST_FAULT``:

- ``poison:N``: a step whose batch holds a prompt containing token id N raises, as a value
  the native code refuses would;
- ``device``: every step raises, as a lost device would;
- ``slow:S``: every step takes S seconds longer, as a big model would (requests stay in
  flight long enough to be caught mid-way).
"""

from __future__ import annotations

import os
import sys
import time

from server.cli import main
from server.engine.worker.model_runner import ModelRunner

FAULT = os.environ.get("HPU_SERVE_TEST_FAULT", "")
_execute = ModelRunner.execute


def faulty_execute(self: ModelRunner, batch, token_bitmask=None):  # noqa: ANN001, ANN201
    if FAULT == "device":
        raise RuntimeError("device lost")
    if FAULT.startswith("slow:"):
        time.sleep(float(FAULT.split(":", 1)[1]))
    if FAULT.startswith("poison:"):
        token = int(FAULT.split(":", 1)[1])
        if any(token in s.prompt_token_ids for s in batch.seqs):
            raise OverflowError("value out of range for the native kernel")
    return _execute(self, batch, token_bitmask)


ModelRunner.execute = faulty_execute  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(main())
