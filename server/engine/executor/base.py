"""Tensor-parallel execution: rank 0 is the engine, ranks 1..N-1 are workers.

The server process is rank 0: it owns the scheduler, builds each step's padded inputs,
samples, and answers requests. An executor starts the other ranks: ``MultiprocExecutor``
(mp.py) as spawned processes on this host (``--distributed-executor-backend mp``),
``RayExecutor`` (ray.py) as Ray actors, possibly on other hosts (``ray``). Whatever starts
them, every worker runs :func:`serve_rank`: it joins rank 0's group, loads its slices of the
weights (tensor_parallel.py) and builds its model runner through the same function as rank 0
(``build_model_runner``: the same limits, KV cache and graph runner), then waits for orders.

An order is one graph-runner call (:class:`Op` ``RUN``, ``WARM`` or ``CAPTURE``) of rank 0,
with the phase, the bucket and the step's :class:`ForwardInputs`, broadcast as one pickled
object
(``broadcast_object_list``: a length, then the bytes); with ``--enable-lora``, also a
:class:`LoRAOrder` to copy an adapter into a slot (the step's inputs name slots, so the
slots' contents must match on every rank). A vision-language model's encoder runs on rank 0
only: a prefill's image rows travel with its order (only the rows under the image mask, not
the step's whole zero-padded grid), so every rank places the very same rows. Sending the
built inputs rather than
the scheduled sequences keeps the workers stateless (nothing to keep in step with rank 0:
no block tables, no sequences) and makes every rank run the very same bucket on the very
same tensors, so their collectives always match. The cost is the inputs' size per step (a
few KiB: token ids, positions, slot mapping, block lists), plus, on an accelerator, a copy
to host memory and back. Every rank computes the gathered logits; only rank 0 samples.

Lifecycle (:class:`RankExecutor`, shared by the backends): rank 0 watches the workers; one
that dies ends the others and is reported to the fault listener the executor was built with
(the engine's owner: the server answers 503 and exits non-zero). A graceful shutdown sends
``Op.STOP``, then kills what has not exited. mp workers ignore
SIGINT/SIGTERM (a signal sent to the whole process group must not kill them under a
draining server) and exit when rank 0 is gone (their parent changes); Ray ends the actors of
a driver that has gone.
"""

from __future__ import annotations

import atexit
import enum
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from server.config import EngineConfig, ExecutionMode
from server.engine.worker.builder import build_model_runner
from server.engine.worker.model_runner import ModelRunner
from server.hpu.distributed import ParallelContext, close_parallel, free_port, tensors_to
from server.hpu.graph_runner import ForwardInputs, ShapeRunner
from server.hpu.platform import Platform, detect_platform
from server.hpu.types import Bucket, Phase, SyncPoint
from server.models.loader import gguf_parse, load_model, resolve_model_source
from server.models.lora import LoRAAdapter, LoRASlots, SlotWriter

logger = logging.getLogger(__name__)

# Called (from a monitor thread) with the fault when a worker rank dies while serving.
FaultListener = Callable[[BaseException], None]
_LOOPBACK = "127.0.0.1"
# how long the start-up waits for every worker to reach the rendezvous
_JOIN_TIMEOUT_S = 300.0
_EXIT_GRACE_S = 10.0


class Op(enum.Enum):
    """What rank 0 tells the workers: repeat one graph-runner call, or stop."""

    RUN = "run"
    WARM = "warm"
    CAPTURE = "capture"
    STOP = "stop"  # broadcast alone, not inside an Order


@dataclass(frozen=True, slots=True)
class Order:
    """One graph-runner call rank 0 makes, for every rank to repeat."""

    op: Op  # RUN, WARM or CAPTURE
    phase: Phase
    bucket: Bucket
    inputs: ForwardInputs  # its mm_embeds sent as None when image_rows carries them
    # a vision-language prefill's image rows ``[rows under inputs.mm_mask, hidden]``, in
    # grid order: the encoder's output (rank 0 runs the encoder); None without images
    image_rows: torch.Tensor | None = None

    @classmethod
    def of(cls, op: Op, phase: Phase, bucket: Bucket, inputs: ForwardInputs) -> Order:
        """The order for rank 0's call, its tensors in host memory (they are pickled)."""
        host = tensors_to(inputs, torch.device("cpu"))
        if host.mm_embeds is None or host.mm_mask is None:
            return cls(op, phase, bucket, host)
        rows = host.mm_embeds[host.mm_mask.view(-1)]
        return cls(op, phase, bucket, replace(host, mm_embeds=None), rows)

    def inputs_on(self, device: torch.device) -> ForwardInputs:
        """Rank 0's inputs rebuilt on ``device`` (image rows back in their grid)."""
        inputs = tensors_to(self.inputs, device)
        if self.image_rows is None or inputs.mm_mask is None:
            return inputs
        mask = inputs.mm_mask.view(-1)
        embeds = torch.zeros(mask.numel(), self.image_rows.shape[-1],
                             dtype=self.image_rows.dtype, device=device)
        embeds[mask] = self.image_rows.to(device)
        return replace(inputs, mm_embeds=embeds)


@dataclass(frozen=True, slots=True)
class LoRAOrder:
    """Copy an adapter (whole, as rank 0 read and checked it; each rank cuts its own part)
    into a LoRA slot, or clear the slot (``adapter`` None). Sent between steps, before the
    step that reads the slot, so every rank's slots match at every step."""

    slot: int
    adapter: LoRAAdapter | None


class BroadcastingSlots:
    """Rank 0's LoRA slots (a :class:`~server.models.lora.SlotWriter`): every copy into a
    slot is ordered to the workers, then made here."""

    def __init__(self, inner: LoRASlots, parallel: ParallelContext) -> None:
        self.inner = inner
        self.parallel = parallel

    @property
    def num_slots(self) -> int:
        return self.inner.num_slots

    @property
    def dtype(self) -> torch.dtype:
        return self.inner.dtype

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        self.parallel.broadcast_object(LoRAOrder(slot, adapter))
        self.inner.load(slot, adapter)

    def clear(self, slot: int) -> None:
        self.parallel.broadcast_object(LoRAOrder(slot, None))
        self.inner.clear(slot)


class BroadcastingRunner(ShapeRunner):
    """Rank 0's graph runner: tells the workers what to run, then runs it itself. Its
    nature is the inner runner's."""

    def __init__(self, inner: ShapeRunner, parallel: ParallelContext) -> None:
        self.inner = inner
        self.parallel = parallel

    @property
    def mode(self) -> ExecutionMode:
        return self.inner.mode

    @property
    def description(self) -> str:
        return self.inner.description

    @property
    def needs_warmup(self) -> bool:
        return self.inner.needs_warmup

    @property
    def captures_graphs(self) -> bool:
        return self.inner.captures_graphs

    @property
    def warmed(self) -> dict[Phase, set[Bucket]]:
        return self.inner.warmed

    def _order(self, op: Op, phase: Phase, bucket: Bucket, inputs: ForwardInputs) -> None:
        self.parallel.broadcast_object(Order.of(op, phase, bucket, inputs))

    def run(self, phase: Phase, bucket: Bucket, inputs: ForwardInputs) -> torch.Tensor:
        self._order(Op.RUN, phase, bucket, inputs)
        return self.inner.run(phase, bucket, inputs)

    def warm(self, phase: Phase, bucket: Bucket, inputs: ForwardInputs) -> None:
        self._order(Op.WARM, phase, bucket, inputs)
        self.inner.warm(phase, bucket, inputs)

    def capture(self, phase: Phase, bucket: Bucket, inputs: ForwardInputs) -> None:
        self._order(Op.CAPTURE, phase, bucket, inputs)
        self.inner.capture(phase, bucket, inputs)

    def can_replay(self, phase: Phase, bucket: Bucket) -> bool:
        return self.inner.can_replay(phase, bucket)

    def sync(self, point: SyncPoint) -> None:
        self.inner.sync(point)


class RankExecutor(ABC):
    """Starts and watches ranks 1..N-1; holds rank 0's :class:`ParallelContext`.

    What is common to every backend lives here: the rendezvous (rank 0 hosts the TCP
    store, waits for every rank's ready key while checking that none has died), the
    monitor that turns a rank's death into an engine fault, and the stop protocol. A
    backend says how ranks are started, watched and killed (the abstract methods).
    ``on_fault`` is called (from the monitor thread) once if a worker dies while serving."""

    def __init__(self, config: EngineConfig, platform: Platform,
                 on_fault: FaultListener | None = None) -> None:
        par = config.parallel
        self.world_size = par.tensor_parallel_size
        self._stopping = False
        self._on_fault = on_fault
        self.fault: BaseException | None = None
        port = free_port()
        atexit.register(self.kill)  # never leave a worker behind, whatever happens
        try:
            host, local_rank = self._start_workers(config, platform, port)
            platform.prepare_rank(local_rank, self.world_size)
            store = dist.TCPStore(host, port, self.world_size, is_master=True,
                                  wait_for_workers=False,
                                  timeout=timedelta(seconds=par.collective_timeout))
            self._wait_for_workers(store)
            if dist.is_initialized():
                # left by an engine of this process that died of a rank fault (its group is
                # not destroyed then: a collective may have been pending); its workers are
                # gone, so nothing can still use it
                logger.warning("Replacing the process group of an earlier engine that died")
                dist.destroy_process_group()
            dist.init_process_group(platform.dist_backend, store=store, rank=0,
                                    world_size=self.world_size,
                                    timeout=timedelta(seconds=par.collective_timeout))
        except BaseException:
            self.kill()
            raise
        self.parallel = ParallelContext(0, self.world_size, platform.device, dist.group.WORLD)
        self._monitor = threading.Thread(target=self._watch, name="tp-monitor", daemon=True)
        self._monitor.start()
        logger.info("Tensor parallelism: %d ranks, backend %s, executor %s", self.world_size,
                    platform.dist_backend, par.distributed_executor_backend)

    # -- what a backend provides ---------------------------------------------------------

    @abstractmethod
    def _start_workers(self, config: EngineConfig, platform: Platform,
                       port: int) -> tuple[str, int]:
        """Starts ranks 1..N-1, each running :func:`serve_rank` against rank 0's store at
        ``port``; returns (the store's host as the workers reach it, the index of rank 0's
        device among the devices this process sees)."""

    @abstractmethod
    def _exited_worker(self) -> str | None:
        """A description of a worker that has exited, or None while all run (no wait)."""

    @abstractmethod
    def _wait_for_exit(self) -> str:
        """Blocks until a worker exits (or is killed); describes it."""

    @abstractmethod
    def _join_workers(self, timeout: float) -> None:
        """Waits up to ``timeout`` seconds for every worker to exit on its own."""

    @abstractmethod
    def _kill_workers(self) -> None:
        """Ends every worker still running and frees what the backend holds (idempotent)."""

    # -- shared ----------------------------------------------------------------------------

    def _wait_for_workers(self, store: Any) -> None:
        """Waits for every worker's ready key, failing fast when one exits first (the
        process-group rendezvous itself would wait out its whole timeout)."""
        deadline = time.monotonic() + _JOIN_TIMEOUT_S
        keys = [f"ready/{rank}" for rank in range(1, self.world_size)]
        while not store.check(keys):
            exited = self._exited_worker()
            if exited is not None:
                raise RuntimeError(f"{exited} during start-up")
            if time.monotonic() > deadline:
                raise TimeoutError("tensor-parallel workers did not start in "
                                   f"{_JOIN_TIMEOUT_S:.0f} s")
            time.sleep(0.05)

    def broadcasting(self, inner: ShapeRunner) -> ShapeRunner:
        """Rank 0's graph runner, which has every rank run what it runs (given to rank 0's
        model runner at construction)."""
        return BroadcastingRunner(inner, self.parallel)

    def broadcasting_lora(self, inner: LoRASlots) -> SlotWriter:
        """Rank 0's LoRA slots, which have every rank copy the same adapter into the same
        slot (given to rank 0's model runner at construction)."""
        return BroadcastingSlots(inner, self.parallel)

    def _watch(self) -> None:
        try:
            exited = self._wait_for_exit()
        except Exception as exc:  # noqa: BLE001 - e.g. Ray torn down under the wait
            exited = f"tensor-parallel workers unreachable ({exc})"
        if self._stopping:
            return
        fault = RuntimeError(exited)
        logger.critical("%s: stopping the other ranks", fault)
        self.fault = fault
        self.kill()  # a collective with a dead rank would never finish
        if self._on_fault is not None:
            self._on_fault(fault)

    def shutdown(self, graceful: bool = True) -> None:
        """Stops every worker: a stop order when ``graceful`` and all are alive and idle
        (no step is running), a kill for any that does not exit within a grace period."""
        if self._stopping:
            return
        self._stopping = True
        if graceful and self.fault is None and self._exited_worker() is None:
            try:
                self.parallel.broadcast_object(Op.STOP)
            except Exception:  # noqa: BLE001 - the kill below still ends them
                logger.warning("tensor-parallel stop order failed; killing the workers")
        self._join_workers(_EXIT_GRACE_S)
        self.kill()
        atexit.unregister(self.kill)
        if graceful and self.fault is None:  # else a collective may still hold the group
            close_parallel(self.parallel)
        logger.info("Tensor-parallel workers stopped")

    def kill(self) -> None:
        """Ends every worker still running (idempotent)."""
        self._stopping = True  # from now on an exit is expected, not a fault
        self._kill_workers()


def build_worker_runner(config: EngineConfig, platform: Platform,
                        parallel: ParallelContext) -> ModelRunner:
    """A worker rank's model runner: its slices, built as rank 0 builds its own (the same
    limits, KV cache geometry and graph runner; no tokenizer, no sampling)."""
    source = resolve_model_source(config.model.model)
    _parse = gguf_parse(source)  # the weights and 4-bit codes share one parse
    loaded = load_model(source, config.model.dtype, platform.device, parallel)
    return build_model_runner(config, platform, source, loaded, parallel)


def serve_rank(config: EngineConfig, rank: int, host: str, port: int, local_rank: int) -> None:
    """The rank loop of every backend: join rank 0's group at ``host:port``, load this
    rank's slices on the device numbered ``local_rank`` among those this process sees, then
    repeat rank 0's orders until it says stop."""
    world = config.parallel.tensor_parallel_size
    timeout = timedelta(seconds=config.parallel.collective_timeout)
    platform = detect_platform(config.device.device)
    platform.prepare_process()
    platform.prepare_rank(local_rank, world)
    store = dist.TCPStore(host, port, world, is_master=False, timeout=timeout)
    store.set(f"ready/{rank}", "1")
    dist.init_process_group(platform.dist_backend, store=store, rank=rank, world_size=world,
                            timeout=timeout)
    parallel = ParallelContext(rank, world, platform.device, dist.group.WORLD)
    runner = build_worker_runner(config, platform, parallel)
    graphs = runner.graphs
    logger.info("Tensor-parallel rank %d ready", rank)
    with torch.inference_mode():
        while True:
            order = parallel.broadcast_object()
            if order is Op.STOP:
                break
            if isinstance(order, LoRAOrder):
                _follow_lora(runner, order)
                continue
            assert isinstance(order, Order), order
            inputs = order.inputs_on(platform.device)
            if order.op is Op.RUN:
                graphs.run(order.phase, order.bucket, inputs)
                graphs.sync(SyncPoint.SAMPLER)  # where rank 0 samples
            elif order.op is Op.WARM:
                graphs.warm(order.phase, order.bucket, inputs)
            elif order.op is Op.CAPTURE:
                graphs.capture(order.phase, order.bucket, inputs)
            else:
                raise ValueError(f"unknown order {order.op!r}")
    close_parallel(parallel)
    logger.info("Tensor-parallel rank %d stopped", rank)


def _follow_lora(runner: ModelRunner, order: LoRAOrder) -> None:
    assert runner.lora is not None, "a LoRA order without --enable-lora"
    if order.adapter is None:
        runner.lora.slots.clear(order.slot)
    else:
        runner.lora.slots.load(order.slot, order.adapter)
