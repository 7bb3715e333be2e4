"""Sleep mode and weight reload for the generating engine (``--enable-sleep-mode``):
``POST /sleep`` frees the KV cache and the weights between steps, ``/wake_up`` restores
them, ``/reload_weights`` swaps the weights in place. The engine thread calls these between
steps; what was freed and not yet restored is kept here."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from server.engine.core.block_manager import BlockManager
from server.engine.errors import EngineSleepingError, RequestError
from server.engine.outputs import RequestOutput
from server.engine.sleep import ALL_TAGS, SleepLevel, WakeTag
from server.engine.worker.model_runner import ModelRunner
from server.models.errors import ModelFileError

logger = logging.getLogger(__name__)


class Sleeper:
    """``abort_all`` ends every request the engine holds and returns their last outputs;
    ``tensor_parallel``: other ranks hold memory this rank cannot free (refused)."""

    def __init__(self, enabled: bool, tensor_parallel: bool, runner: ModelRunner,
                 block_manager: BlockManager,
                 abort_all: Callable[[], list[RequestOutput]]) -> None:
        self.enabled = enabled
        self.tensor_parallel = tensor_parallel
        self.runner = runner
        self.block_manager = block_manager
        self.abort_all = abort_all
        # what /sleep freed and no /wake_up has restored yet (empty: awake)
        self.asleep: set[WakeTag] = set()
        # the deepest level slept since the engine was last wholly awake (vllm:engine_sleep_state)
        self.level: SleepLevel | None = None

    @property
    def is_sleeping(self) -> bool:
        """Asleep from ``sleep`` until a wake has restored everything it freed."""
        return bool(self.asleep)

    def check_awake(self) -> None:
        """Before a request is queued."""
        if self.asleep:
            raise EngineSleepingError("the engine is sleeping (POST /wake_up to resume)")

    def sleep(self, level: SleepLevel) -> list[RequestOutput]:
        """Aborts every request (their last outputs are returned, finish_reason "abort"),
        forgets every cached prefix, then frees the KV cache and the weights as ``level``
        says. Asleep already: frees more (level 2 after level 1), never less."""
        self._check_enabled()
        ended = self.abort_all()
        bm = self.block_manager
        bm.reset_prefix_cache()
        assert bm.num_free_blocks == bm.num_blocks, "a KV block outlived its request"
        self.runner.sleep(level)
        self.asleep = set(ALL_TAGS)
        self.level = max(level, self.level or level)
        weights = self.runner.memory.weights_bytes if self.runner.memory is not None else 0
        logger.info("Asleep (level %d): %d request(s) aborted, %.1f MiB of KV cache and "
                    "%.1f MiB of weights %s", level, len(ended),
                    self.runner.kv_cache_bytes / 2**20, weights / 2**20,
                    "dropped" if level is SleepLevel.DISCARD else "offloaded to host memory"
                    if self.runner.platform.device.type != "cpu" else "kept (host memory)")
        return ended

    def wake_up(self, tags: frozenset[WakeTag] = ALL_TAGS) -> None:
        """Restores what ``tags`` name (everything by default); the KV cache comes back
        empty, with no cached prefix."""
        self._check_enabled()
        start = time.monotonic()
        self.runner.wake_up(tags)
        self._restored(tags)
        if WakeTag.KV_CACHE in tags:
            self.block_manager.reset_prefix_cache()
        logger.info("Woke %s in %.2f s%s", "/".join(sorted(t.value for t in tags)),
                    time.monotonic() - start,
                    "" if not self.asleep else " (still asleep: "
                    + "/".join(sorted(t.value for t in self.asleep)) + " not restored)")

    def reload_weights(self, path: str) -> None:
        """Swaps in the weights at ``path`` (same architecture and shapes, else a
        RequestError naming what differs), in place. Cached prefixes are forgotten (their
        K/V came from the old weights); running requests go on with the new weights."""
        self._check_enabled()
        start = time.monotonic()
        try:
            self.runner.reload_weights(path)
        except (ModelFileError, ValueError, OSError) as exc:  # a mismatch is a ValueError
            raise RequestError(str(exc), "path") from None
        self.block_manager.reset_prefix_cache()
        self._restored(frozenset({WakeTag.WEIGHTS}))
        logger.info("Reloaded the weights from %s in %.2f s", path, time.monotonic() - start)

    def _restored(self, tags: frozenset[WakeTag]) -> None:
        self.asleep -= tags
        if not self.asleep:
            self.level = None

    def _check_enabled(self) -> None:
        if not self.enabled:
            raise RequestError("sleep mode is off: start with --enable-sleep-mode")
        if self.tensor_parallel:
            raise RequestError("sleep mode and weight reload do not support tensor "
                               "parallelism yet (--tensor-parallel-size > 1): the other "
                               "ranks' memory would stay in use")
