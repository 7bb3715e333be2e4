"""Log setup shared by the CLI, the offline API and worker processes; the request id context.

Text (the default) puts one handler on the ``server`` logger, as always. JSON puts one on the
root logger, so that every logger of the process (``server.*``, uvicorn's, libraries',
``warnings``, uncaught exceptions) writes one JSON object per line:
``{"timestamp", "level", "logger", "message", "pid", ["request_id"], ["exception"], ...}``.

The request id travels in a context variable: the HTTP middleware sets it for a request's
task (and so for every task and ``to_thread`` job started from it), and each line logged
there carries it. Structured lines (request logs, the stats line) pass their fields as
``extra={FIELDS: {...}}``: top-level keys in JSON, ``key=value`` pairs after the text.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import sys
import threading
import types
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from typing import Any

from server.config.logging import LogFormat

_FORMAT = "%(levelname)s %(asctime)s %(name)s: %(message)s"
_DATEFMT = "%m-%d %H:%M:%S"
FIELDS = "fields"  # the ``extra`` key of a line's structured fields
_CORE = ("timestamp", "level", "logger", "message", "pid", "request_id", "exception")
# uvicorn's access line: '%s - "%s %s HTTP/%s" %d' with these arguments
_ACCESS_ARGS = ("client", "method", "path", "http_version", "status")
_OURS = "_hpu_serve_handler"  # marks the handlers init_logging installed

_request_id: ContextVar[str | None] = ContextVar("hpu_serve_request_id", default=None)
_active = LogFormat.TEXT


def current_request_id() -> str | None:
    """The id of the HTTP request this code runs for (None outside one)."""
    return _request_id.get()


@contextlib.contextmanager
def request_context(request_id: str | None) -> Iterator[None]:
    """Lines logged inside (and in tasks started inside) carry ``request_id``."""
    token = _request_id.set(request_id)
    try:
        yield
    finally:
        _request_id.reset(token)


def active_format() -> LogFormat:
    """The format this process logs in: a worker process it starts is given the same."""
    return _active


def _text_value(value: Any) -> str:
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False) if (" " in value or not value) else value
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value, ensure_ascii=False, default=str, separators=(",", ":"))
    return str(value)


class TextFormatter(logging.Formatter):
    """The text line, then a structured line's fields as ``key=value``."""

    def __init__(self) -> None:
        super().__init__(_FORMAT, datefmt=_DATEFMT)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields: Mapping[str, Any] | None = getattr(record, FIELDS, None)
        if not fields:
            return line
        pairs = " ".join(f"{k}={_text_value(v)}" for k, v in fields.items() if v is not None)
        head, sep, tail = line.partition("\n")  # pairs stay on the message's line
        return f"{head} {pairs}{sep}{tail}"


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (tracebacks included, as a field)."""

    def format(self, record: logging.LogRecord) -> str:
        created = datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
        data: dict[str, Any] = {
            "timestamp": created.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "pid": record.process,
        }
        request_id = getattr(record, "request_id", None) or _request_id.get()
        if request_id is not None:
            data["request_id"] = request_id
        if record.name == "uvicorn.access" and isinstance(record.args, tuple) and \
                len(record.args) == len(_ACCESS_ARGS):
            data.update(zip(_ACCESS_ARGS, record.args))
        fields: Mapping[str, Any] | None = getattr(record, FIELDS, None)
        for key, value in (fields or {}).items():
            if key not in _CORE:
                data[key] = value
        if record.exc_info:
            data["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            data["exception"] = record.exc_text
        if record.stack_info:
            data["stack"] = self.formatStack(record.stack_info)
        return json.dumps(data, ensure_ascii=False, default=str)


def formatter(fmt: LogFormat) -> logging.Formatter:
    return JsonFormatter() if fmt is LogFormat.JSON else TextFormatter()


def init_logging(fmt: LogFormat = LogFormat.TEXT, level: int | str = logging.INFO) -> None:
    """Idempotent; in text, leaves alone a ``server`` logger the application already
    configured (the offline API inside someone's program)."""
    global _active
    server_logger = logging.getLogger("server")
    if fmt is LogFormat.TEXT:
        if server_logger.handlers:
            return
        _active = fmt
        server_logger.addHandler(_handler(fmt))
        server_logger.setLevel(level)
        server_logger.propagate = False
        return
    _active = fmt
    root = logging.getLogger()
    if any(getattr(h, _OURS, False) for h in root.handlers):
        return
    for handler in [h for h in server_logger.handlers if getattr(h, _OURS, False)]:
        server_logger.removeHandler(handler)  # a text handler of an earlier call
    root.addHandler(_handler(fmt))
    server_logger.setLevel(level)
    server_logger.propagate = True  # to the root's JSON handler
    logging.captureWarnings(True)  # warnings.warn -> the "py.warnings" logger
    sys.excepthook = _log_uncaught
    threading.excepthook = _log_uncaught_in_thread


def _handler(fmt: LogFormat) -> logging.Handler:
    handler = logging.StreamHandler()  # stderr
    handler.setFormatter(formatter(fmt))
    setattr(handler, _OURS, True)
    return handler


def _log_uncaught(kind: type[BaseException], exc: BaseException,
                  tb: types.TracebackType | None) -> None:
    logging.getLogger("server").critical("uncaught exception", exc_info=(kind, exc, tb))


def _log_uncaught_in_thread(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit:
        return
    name = args.thread.name if args.thread is not None else "?"
    exc = args.exc_value if args.exc_value is not None else args.exc_type()
    logging.getLogger("server").critical("uncaught exception in thread %s", name,
                                         exc_info=(args.exc_type, exc, args.exc_traceback))


def uvicorn_log_config(fmt: LogFormat, default: dict[str, Any]) -> dict[str, Any]:
    """uvicorn's ``log_config``: its own (``default``) in text; in JSON its loggers write
    through :class:`JsonFormatter` (levels still set by ``--uvicorn-log-level``)."""
    if fmt is LogFormat.TEXT:
        return default
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"json": {"()": f"{__name__}.JsonFormatter"}},
        "handlers": {"json": {"class": "logging.StreamHandler", "formatter": "json",
                              "stream": "ext://sys.stderr"}},
        "loggers": {
            "uvicorn": {"handlers": ["json"], "level": "INFO", "propagate": False},
            "uvicorn.error": {"level": "INFO"},
            "uvicorn.access": {"handlers": ["json"], "level": "INFO", "propagate": False},
        },
    }
