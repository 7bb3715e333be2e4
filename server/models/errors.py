"""The error a damaged or inconsistent model file raises: its own type, so that start-up
can print one line for it (``error: model file ...``) while a bug keeps its traceback."""

from __future__ import annotations


class ModelFileError(ValueError):
    """A model file that cannot be served as it is: truncated, corrupt, or at odds with its
    config. The message names the file and, where one is to blame, the tensor."""


class MissingModelFileError(ModelFileError, FileNotFoundError):
    """A file the model needs is not there (a shard its index lists, the weights, the
    model path itself); still a FileNotFoundError for callers that catch that."""


def model_file_error(path: object, what: str) -> ModelFileError:
    """``model file PATH: WHAT``, the one line start-up prints."""
    return ModelFileError(f"model file {path}: {what}")
