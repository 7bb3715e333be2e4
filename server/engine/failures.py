"""What the engine step does when something goes wrong, so that one request's fault ends
that request only: a batch that raised is re-run request by request; a request the
scheduler can never place ends with an error instead of the engine spinning; steps in
which every request fails point at the device, and after a few in a row the engine stops
(``EngineFaultError``: the server exits for its orchestrator to restart it)."""

from __future__ import annotations

from collections.abc import Callable

from server.engine.core.scheduler import Scheduler
from server.engine.core.sequence import ScheduledBatch
from server.engine.core.sequence import Sequence as Seq
from server.engine.errors import EngineFaultError, RequestFailedError
from server.engine.output_processor import OutputProcessor
from server.engine.outputs import EngineStats, RequestOutput

# Consecutive steps in which every request failed before the engine declares a device fault.
MAX_FAILED_STEPS = 3


class FailedSteps:
    """Counts the steps in a row in which every request failed (both engines use one)."""

    def __init__(self, what: str) -> None:
        self.what = what  # "engine" or "pooling": named in the fault
        self.count = 0

    def reset(self) -> None:
        """A step ran as a whole."""
        self.count = 0

    def observe(self, succeeded: bool, exc: BaseException) -> None:
        """After a step that raised and was retried request by request: raises
        EngineFaultError once MAX_FAILED_STEPS steps in a row saved no request."""
        self.count = 0 if succeeded else self.count + 1
        if self.count >= MAX_FAILED_STEPS:
            raise EngineFaultError(
                f"{self.count} {self.what} steps in a row failed for every request in them; "
                f"last error: {exc!r}") from exc


RunBatch = Callable[[ScheduledBatch], list[RequestOutput]]


class RequestIsolation:
    """The generating engine's failure paths. ``run`` executes a batch and retires what it
    finished (the engine's normal path); ``stats`` gives the scheduler's state for errors."""

    def __init__(self, scheduler: Scheduler, output_processor: OutputProcessor,
                 run: RunBatch, stats: Callable[[], EngineStats]) -> None:
        self.scheduler = scheduler
        self.output_processor = output_processor
        self.run = run
        self.stats = stats
        self.failed_steps = FailedSteps("engine")

    def step_ran(self) -> None:
        """A batch ran as a whole: the count of failed steps starts again."""
        self.failed_steps.reset()

    def isolate(self, batch: ScheduledBatch, exc: Exception) -> list[RequestOutput]:
        """A step raised: run each request of the batch on its own, so that a fault tied to
        one request ends that request only. Re-running is safe: nothing was committed (the
        KV slots are rewritten with the same values)."""
        by_request: dict[str, list[Seq]] = {}
        for seq in batch.seqs:
            by_request.setdefault(seq.request_id, []).append(seq)
        outputs: list[RequestOutput] = []
        succeeded = False
        for request_id, seqs in by_request.items():
            error: Exception = exc
            if len(by_request) > 1:
                try:
                    outputs += self.run(batch.subset(seqs))
                except Exception as sub_exc:  # noqa: BLE001 - this request's own fault
                    error = sub_exc
                else:
                    succeeded = True
                    continue
            outputs += self._fail(request_id, error)
        self.failed_steps.observe(succeeded, exc)
        return outputs

    def unplaceable(self) -> list[RequestOutput]:
        """The scheduler placed nothing although requests wait and nothing decodes: nothing
        will free room, so the next step would place nothing either and the engine would
        spin forever (a token budget that rounds every chunk to zero did, once). Ends the
        request that cannot be placed, with the scheduler's state in the error, so that
        the others go on."""
        scheduler = self.scheduler
        seq = scheduler.running[0] if scheduler.running else scheduler.waiting[0]
        stats = self.stats()
        return self._fail(seq.request_id, RequestFailedError(seq.request_id, (
            f"the scheduler could not place it ({seq.num_tokens} tokens, "
            f"{seq.num_computed_tokens} computed; {stats.num_free_blocks} of "
            f"{stats.num_blocks} KV blocks free; {scheduler.num_running} running, "
            f"{scheduler.num_waiting} waiting)")))

    def _fail(self, request_id: str, error: Exception) -> list[RequestOutput]:
        self.scheduler.abort(request_id)
        failure = self.output_processor.fail(request_id, error)
        return [failure] if failure is not None else []
