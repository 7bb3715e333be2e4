"""Log setup shared by the CLI and the offline API: one handler on the ``server`` logger."""

from __future__ import annotations

import logging

_FORMAT = "%(levelname)s %(asctime)s %(name)s: %(message)s"


def init_logging(level: int | str = logging.INFO) -> None:
    """Idempotent; leaves alone a ``server`` logger the application already configured."""
    logger = logging.getLogger("server")
    if logger.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%m-%d %H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
