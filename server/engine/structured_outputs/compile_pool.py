"""A bounded pool of grammar compile workers (child processes), with a hard time limit.

Why processes: xgrammar's compilation is one uninterruptible C++ call, and its cost is not
bounded by the size of its input (a 1 MB enum of long strings takes ~50 s even with a tiny
vocabulary). A thread running it cannot be stopped; a process can be killed. So every new
constraint is first compiled by a worker (``compile_worker``): beyond ``timeout`` the worker
is killed and replaced, and the request gets a 400.

Why the worker does not send the compiled grammar back: xgrammar can serialize one
(``CompiledGrammar.serialize_json`` / ``deserialize_json`` with the tokenizer's metadata),
but the serialized form holds a copy of the whole automaton per rule. Measured with the
embedded model's 49k vocabulary: a schema with 400 anyOf branches compiles in 0.05 s and
serializes in 5.2 s to 35 MB (1.1 s to read back); 1,024 branches: 0.14 s to compile, 20 s
and 234 MB to serialize. Moving grammars between processes would cost up to 100x the
compilation. Instead the worker reports how long the compilation took, and the server then
compiles the same text itself on a thread of its own grammar pool (``structured_outputs``):
a compilation known to end within the limit, since compiling is deterministic. A grammar
thus costs its compile time twice the first time, and nothing once cached.

Scheduling: jobs wait in one queue per client, served round-robin, so one client's
expensive grammars queue behind each other, not in front of everyone. At most ``workers``
compile at once; workers start on demand and run at a lower CPU priority than the server.
Identical constraints in flight share one job. A caller that cancels its future (a client
that disconnected) leaves the queue at once; a running job whose every caller has gone is
killed at once (killing is cheaper than finishing: a worker restarts in ~0.8 s).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, Pipe, wait
from pathlib import Path

from server.engine.structured_outputs.limits import GrammarSource
from server.log import active_format

logger = logging.getLogger(__name__)

# A worker that dies this many times in a row before it is ready means the compiler cannot
# run here (xgrammar missing, no memory): queued jobs fail instead of retrying forever.
MAX_START_FAILURES = 3
# The package root, from which ``-m server.engine.structured_outputs.compile_worker`` resolves.
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


class CompileTimeout(Exception):
    """The worker overran the time limit and was killed."""


class CompileFailed(Exception):
    """The compiler rejected the source (the library's message), or the worker died."""


@dataclass(frozen=True, slots=True)
class CompileReport:
    seconds: float
    memory_bytes: int


@dataclass(eq=False)
class _Job:
    source: GrammarSource
    client: str
    waiters: list[Future[CompileReport]] = field(default_factory=list)

    @property
    def abandoned(self) -> bool:
        return all(w.cancelled() for w in self.waiters)

    def settle(self, result: CompileReport | BaseException) -> None:
        for waiter in self.waiters:
            with contextlib.suppress(InvalidStateError):  # cancelled meanwhile
                if isinstance(result, BaseException):
                    waiter.set_exception(result)
                else:
                    waiter.set_result(result)


@dataclass(eq=False)
class _Worker:
    proc: subprocess.Popen[bytes]
    conn: Connection
    ready: bool = False
    job: _Job | None = None
    deadline: float = 0.0

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        self.conn.close()


class GrammarPool:
    """``submit(source, client)`` -> a future of the compile report (or CompileTimeout /
    CompileFailed). Thread-safe; one manager thread owns the workers."""

    def __init__(self, tokenizer_info_json: str, workers: int, timeout: float) -> None:
        self.max_workers = workers
        self.timeout = timeout
        self._init = (tokenizer_info_json, timeout)
        self._lock = threading.Lock()
        self._queues: collections.OrderedDict[str, collections.deque[_Job]] = (
            collections.OrderedDict())
        self._jobs: dict[GrammarSource, _Job] = {}  # queued or running, for sharing
        self._workers: list[_Worker] = []
        self._start_failures = 0
        self._closed = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_w.setblocking(False)
        self._thread: threading.Thread | None = None
        # counters, for tests and logs
        self.started_workers = 0
        self.killed_workers = 0

    def submit(self, source: GrammarSource, client: str = "") -> Future[CompileReport]:
        waiter: Future[CompileReport] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the grammar pool is closed")
            job = self._jobs.get(source)
            if job is None or job.abandoned:
                job = _Job(source, client)
                self._jobs[source] = job
                self._queues.setdefault(client, collections.deque()).append(job)
            job.waiters.append(waiter)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="grammar-pool",
                                                daemon=True)
                self._thread.start()
        waiter.add_done_callback(lambda _: self._wake())  # a cancel must reach the manager
        self._wake()
        return waiter

    @property
    def busy_workers(self) -> int:
        with self._lock:
            return sum(1 for w in self._workers if w.job is not None)

    @property
    def live_workers(self) -> int:
        with self._lock:
            return len(self._workers)

    @property
    def queued_jobs(self) -> int:
        with self._lock:
            return sum(1 for q in self._queues.values() for j in q if not j.abandoned)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            thread = self._thread
        self._wake()
        if thread is not None:
            thread.join(timeout=10)
        else:
            self._shutdown()

    # -- the manager thread ------------------------------------------------------------

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):  # full: a wake-up is pending
            self._wake_w.send(b"x")

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    if self._closed:
                        break
                    self._kill_abandoned()
                    self._dispatch()
                    workers = list(self._workers)
                deadlines = [w.deadline for w in workers if w.job is not None]
                wait_s = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
                ready = wait([w.conn for w in workers] + [self._wake_r], wait_s)
                if self._wake_r in ready:
                    with contextlib.suppress(BlockingIOError, OSError):
                        self._wake_r.recv(4096)
                for worker in workers:
                    if worker.conn in ready:
                        self._receive(worker)
                self._expire()
        except Exception:  # noqa: BLE001 - the pool must fail its jobs, not hang them
            logger.exception("the grammar pool's manager died")
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        with self._lock:
            self._closed = True
            workers, self._workers = self._workers, []
            jobs = list(self._jobs.values())
            self._jobs.clear()
            self._queues.clear()
        for worker in workers:
            worker.kill()
        for job in jobs:
            job.settle(CompileFailed("the server is shutting down"))
        self._wake_r.close()
        self._wake_w.close()

    def _next_job(self) -> _Job | None:
        """Round-robin over clients; abandoned jobs are dropped on the way."""
        while self._queues:
            client, queue = next(iter(self._queues.items()))
            job = queue.popleft()
            if queue:
                self._queues.move_to_end(client)
            else:
                del self._queues[client]
            if not job.abandoned:
                return job
            self._forget(job)
        return None

    def _dispatch(self) -> None:
        while True:
            idle = next((w for w in self._workers if w.ready and w.job is None), None)
            if idle is None:
                starting = sum(1 for w in self._workers if not w.ready)
                waiting = sum(1 for q in self._queues.values() for j in q if not j.abandoned)
                if waiting > starting and len(self._workers) < self.max_workers:
                    try:
                        self._spawn()
                    except OSError as exc:  # no process can start (fork failed)
                        logger.error("cannot start a grammar compile worker: %s", exc)
                        self._fail_queued()
                return
            job = self._next_job()
            if job is None:
                return
            try:
                idle.conn.send((job.source.kind.value, job.source.text))
            except OSError:  # died while idle: its EOF is read next round
                self._queues.setdefault(job.client, collections.deque()).appendleft(job)
                idle.ready = False
                return
            idle.job = job
            idle.deadline = time.monotonic() + self.timeout

    def _spawn(self) -> None:
        ours, theirs = Pipe()
        proc = subprocess.Popen(
            [sys.executable, "-m", "server.engine.structured_outputs.compile_worker",
             str(theirs.fileno()), str(active_format())],  # it logs as this process does
            cwd=_PACKAGE_ROOT, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL)
        theirs.close()
        self._workers.append(_Worker(proc, ours))
        self.started_workers += 1
        # ~1.6 MB of vocabulary: sent from a helper thread so that the manager never waits
        # for a child to start reading (the worker answers "ready" only after reading it)
        threading.Thread(target=self._send_init, args=(ours,), daemon=True).start()

    def _send_init(self, conn: Connection) -> None:
        with contextlib.suppress(OSError):
            conn.send(self._init)

    def _receive(self, worker: _Worker) -> None:
        try:
            message = worker.conn.recv()
        except (EOFError, OSError):
            self._lost(worker, CompileFailed("the grammar compiler crashed on it"))
            return
        with self._lock:
            if message[0] == "ready":
                worker.ready = True
                self._start_failures = 0
                return
            job, worker.job = worker.job, None
            if job is not None:
                self._forget(job)
        if job is None:
            return
        if message[0] == "ok":
            job.settle(CompileReport(float(message[1]), int(message[2])))
        else:
            job.settle(CompileFailed(str(message[1])))

    def _expire(self) -> None:
        now = time.monotonic()
        for worker in list(self._workers):
            if worker.job is not None and now >= worker.deadline:
                self._lost(worker, CompileTimeout(f"over {self.timeout:g} s"))

    def _kill_abandoned(self) -> None:
        """(lock held)"""
        for worker in list(self._workers):
            if worker.job is not None and worker.job.abandoned:
                self._forget(worker.job)
                self._remove(worker)
                with contextlib.suppress(OSError):
                    self._spawn()

    def _lost(self, worker: _Worker, error: Exception) -> None:
        """A worker killed at the limit, or dead: its job fails, a new worker may start."""
        with self._lock:
            was_ready = worker.ready
            job = worker.job
            self._remove(worker)
            if job is not None:
                self._forget(job)
            if was_ready and not self._closed:  # its replacement starts now, not on demand
                with contextlib.suppress(OSError):
                    self._spawn()
            if not was_ready:
                self._start_failures += 1
                failed = self._start_failures >= MAX_START_FAILURES
                if failed:
                    logger.error("grammar compile workers fail to start (exit code %s)",
                                 worker.proc.returncode)
                    self._fail_queued()
                    self._start_failures = 0
        if job is not None:
            job.settle(error)

    def _fail_queued(self) -> None:
        """(lock held)"""
        stranded = [job for queue in self._queues.values() for job in queue]
        self._queues.clear()
        for job in stranded:
            self._forget(job)
            job.settle(CompileFailed("the grammar compiler is unavailable"))

    def _remove(self, worker: _Worker) -> None:
        """(lock held)"""
        worker.kill()
        if worker.job is not None:
            self.killed_workers += 1
        self._workers.remove(worker)

    def _forget(self, job: _Job) -> None:
        """(lock held)"""
        if self._jobs.get(job.source) is job:
            del self._jobs[job.source]
