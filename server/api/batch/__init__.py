"""``hpu-serve run-batch``: an OpenAI batch file answered by the server's own routes."""

from server.api.batch.protocol import BatchFileError, BatchRequestInput, read_batch
from server.api.batch.runner import run_batch

__all__ = ["BatchFileError", "BatchRequestInput", "read_batch", "run_batch"]
