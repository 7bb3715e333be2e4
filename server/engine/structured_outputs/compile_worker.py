"""A grammar compile worker: a child process that compiles the constraints it is sent and
says how long each took. Run by ``compile_pool`` as
``python -m server.engine.structured_outputs.compile_worker FD FORMAT`` (FD: its end of a
socket pair; FORMAT: the server's ``--log-format``, so that its lines match the server's).

It exists to be killed: xgrammar's compilation cannot be interrupted, so a constraint that
overruns ``--grammar-compile-timeout`` costs this process, not a thread of the server.

Protocol (pickled tuples over the connection):
  pool -> worker: ``(tokenizer_info_json, timeout)`` once, then ``(GrammarKind, text)`` jobs;
  worker -> pool: ``("ready",)`` once set up, then per job ``("ok", seconds, memory_bytes)``
  or ``("error", message)``.

Torch-free: importing ``xgrammar`` as a package pulls in torch (its matcher module, and
tvm_ffi imports torch when it can), 1.3 s and 260 MB per worker for nothing. The worker
needs only the compiler, so torch is blocked and the package's ``__init__`` bypassed: 0.8 s
and 80 MB (measured on the 2-core dev machine).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import os
import signal
import sys
import time
import types
from multiprocessing.connection import Connection
from typing import Any

# below the engine and the event loop: a grammar is background work
WORKER_NICENESS = 10
# If the pool is gone (killed with the server), a worker still ends its own overrun job:
# SIGALRM's default action ends the process.
SELF_LIMIT_FACTOR = 2.0
SELF_LIMIT_GRACE_S = 5.0


def import_compiler() -> tuple[Any, Any]:
    """xgrammar's ``compiler`` and ``tokenizer_info`` modules, without torch where this
    xgrammar's layout allows it (another version's may not: then the plain import, torch
    and all, which costs memory and start-up time but compiles the same)."""
    if "xgrammar" not in sys.modules:
        try:
            _import_without_torch()
        except ImportError:
            for name in [m for m in sys.modules if m == "xgrammar" or m.startswith("xgrammar.")]:
                del sys.modules[name]
            if sys.modules.get("torch", False) is None:
                del sys.modules["torch"]
            importlib.import_module("xgrammar")
    return (importlib.import_module("xgrammar.compiler"),
            importlib.import_module("xgrammar.tokenizer_info"))


def _import_without_torch() -> None:
    if "torch" not in sys.modules:
        sys.modules["torch"] = None  # type: ignore[assignment]  # "import torch" fails fast
    # transformers (imported by tokenizer_info) warns that it found no torch: true, and moot
    logging.getLogger("transformers").addFilter(lambda record: False)
    spec = importlib.util.find_spec("xgrammar")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("xgrammar is not installed")
    package = types.ModuleType("xgrammar")  # the package, minus its __init__
    package.__path__ = list(spec.submodule_search_locations)
    sys.modules["xgrammar"] = package
    importlib.import_module("xgrammar.load_binding")
    importlib.import_module("xgrammar.exception")  # maps C++ errors to Python ones
    importlib.import_module("xgrammar.compiler")
    importlib.import_module("xgrammar.tokenizer_info")


def compile_source(compiler: Any, kind: str, text: str) -> Any:
    """Compiles one source with xgrammar (shared by the worker and the server)."""
    if kind == "JSON schema":
        # Compact JSON: with free whitespace a small model at temperature 1 can pad forever
        # and hit max_tokens mid-object.
        return compiler.compile_json_schema(text, any_whitespace=False)
    if kind == "regex":
        return compiler.compile_regex(text)
    return compiler.compile_grammar(text)


def serve(conn: Connection) -> int:
    with contextlib.suppress(OSError):
        os.nice(WORKER_NICENESS)
    info_json, timeout = conn.recv()
    compiler_module, info_module = import_compiler()
    info = info_module.TokenizerInfo.deserialize_json(info_json)
    compiler = compiler_module.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    conn.send(("ready",))
    self_limit = timeout * SELF_LIMIT_FACTOR + SELF_LIMIT_GRACE_S
    while True:
        try:
            kind, text = conn.recv()
        except (EOFError, OSError):  # the pool closed (or died): nothing more to do
            return 0
        start = time.perf_counter()
        signal.setitimer(signal.ITIMER_REAL, self_limit)
        try:
            compiled = compile_source(compiler, str(kind), text)
            reply: tuple[Any, ...] = ("ok", time.perf_counter() - start,
                                      int(compiled.memory_size_bytes))
            del compiled  # nothing is kept between jobs
        except Exception as exc:  # noqa: BLE001 - the library reports bad input many ways
            reply = ("error", str(exc))
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        try:
            conn.send(reply)
        except (BrokenPipeError, OSError):
            return 0


def main(argv: list[str]) -> int:
    """``argv``: [program, FD, log format (the server's ``--log-format``; text if absent)]."""
    from server.config.logging import LogFormat
    from server.log import init_logging

    init_logging(LogFormat(argv[2]) if len(argv) > 2 else LogFormat.TEXT)
    return serve(Connection(int(argv[1])))


if __name__ == "__main__":
    sys.exit(main(sys.argv))
