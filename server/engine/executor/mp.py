"""``--distributed-executor-backend mp``: ranks 1..N-1 as spawned processes on this host.

Each worker runs :func:`~server.engine.executor.base.serve_rank` after ignoring the process
group's signals (a signal sent to the whole group must not kill a worker under a draining
server) and watching its parent: it exits when rank 0 has gone.

Spawn starts a worker by re-importing the main module of rank 0's process: a script that
builds an engine at its top level, without ``if __name__ == "__main__":``, would build it
again in every worker. :func:`refuse_engine_in_worker` stops that with the fix spelled out.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
from typing import cast

from server.config import EngineConfig, LogFormat
from server.engine.executor.base import RankExecutor, serve_rank
from server.hpu.platform import Platform
from server.log import active_format, init_logging

logger = logging.getLogger(__name__)

_LOOPBACK = "127.0.0.1"
_WORKER_NAME = "hpu-serve-tp"  # + rank: how a worker knows itself, even while bootstrapping
# A worker's exit code when the main module it re-imported builds an engine: rank 0 reads it
# to add the fix to its start-up error (an exception's exit code, 1, says nothing).
UNGUARDED_MAIN_EXIT = 3
_GUARD = 'if __name__ == "__main__":'


class MultiprocExecutor(RankExecutor):
    """``--distributed-executor-backend mp``: ranks 1..N-1 are spawned processes on this
    host, meeting rank 0 over loopback; rank r uses the host's device r."""

    def _start_workers(self, config: EngineConfig, platform: Platform,
                       port: int) -> tuple[str, int]:
        refuse_engine_in_worker()
        spawn = multiprocessing.get_context("spawn")  # fork can hang device runtimes
        self.workers = [
            spawn.Process(target=worker_main,
                          args=(config, rank, _LOOPBACK, port, rank, os.getpid(),
                                active_format()),
                          name=f"{_WORKER_NAME}{rank}")
            for rank in range(1, self.world_size)
        ]
        for rank, worker in enumerate(self.workers, start=1):
            worker.start()
            logger.info("Tensor-parallel worker rank %d started (pid %d)", rank, worker.pid)
        return _LOOPBACK, 0

    def _describe(self, rank: int) -> str:
        worker = self.workers[rank - 1]
        why = ""
        if worker.exitcode == UNGUARDED_MAIN_EXIT:
            why = (f": the script builds the engine at its top level, which spawn runs "
                   f"again in each worker; put that code under `{_GUARD}`")
        return (f"tensor-parallel worker rank {rank} (pid {worker.pid}) exited "
                f"(exit code {worker.exitcode}{why})")

    def _exited_worker(self) -> str | None:
        for rank, worker in enumerate(getattr(self, "workers", []), start=1):
            if not worker.is_alive():
                return self._describe(rank)
        return None

    def _wait_for_exit(self) -> str:
        sentinels = {w.sentinel: rank for rank, w in enumerate(self.workers, start=1)}
        ready = multiprocessing.connection.wait(list(sentinels))
        rank = sentinels[cast(int, ready[0])]  # we waited on sentinels: ints
        self.workers[rank - 1].join(1)  # for its exit code
        return self._describe(rank)

    def _join_workers(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for worker in self.workers:
            worker.join(max(0.0, deadline - time.monotonic()))

    def _kill_workers(self) -> None:
        # SIGKILL and reap: a worker ignores SIGTERM by design
        for worker in getattr(self, "workers", []):
            if worker.pid is None:
                continue  # never started (a failed start): nothing to end
            if worker.is_alive():
                worker.kill()
            worker.join(5)


def worker_main(config: EngineConfig, rank: int, host: str, port: int, local_rank: int,
                parent_pid: int, log_format: LogFormat = LogFormat.TEXT) -> None:
    """Entry point of an mp worker: ignore the process group's signals, log as rank 0 does
    (``log_format``), follow the parent (rank 0) out, then :func:`serve_rank`."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    init_logging(log_format)
    _exit_with_parent(parent_pid)
    try:
        serve_rank(config, rank, host, port, local_rank)
    except Exception:
        logger.exception("tensor-parallel rank %d failed", rank)
        os._exit(1)  # skip a teardown that could wait on the broken process group


def _exit_with_parent(parent_pid: int) -> None:
    """Ends this worker when rank 0 has gone (even by SIGKILL): it would otherwise wait
    for orders forever."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def refuse_engine_in_worker() -> None:
    """Exits this process, saying what to add, if it is a tensor-parallel worker about to
    build an engine: only the main module re-imported by spawn does that (a worker serves
    its rank; it never builds an engine or starts workers of its own)."""
    name = multiprocessing.current_process().name  # set by spawn before it imports main
    if not name.startswith(_WORKER_NAME):
        return
    # spawn runs the script as __mp_main__ (it becomes __main__ once it has run)
    main = sys.modules.get("__mp_main__") or sys.modules.get("__main__")
    script = getattr(main, "__file__", None) or "the main module"
    print(
        f"\nhpu-serve: {script} builds an engine with tensor_parallel_size > 1 at its top "
        f"level.\nEach tensor-parallel worker is a spawned process, and spawn runs the "
        f"main module again in it,\nso every worker would build the engine too. Put the "
        f"code that builds and uses the engine under a main guard:\n\n"
        f"    {_GUARD}\n        llm = LLM(...)\n        ...\n", file=sys.stderr, flush=True)
    raise SystemExit(UNGUARDED_MAIN_EXIT)
