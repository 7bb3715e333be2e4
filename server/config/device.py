"""Where and how the model executes: the device, its execution mode, tensor parallelism."""

from __future__ import annotations

import enum
import importlib.util
from dataclasses import dataclass

from server.config.fields import flag, knob


class ExecutionMode(str, enum.Enum):
    """How shapes become device work (``--execution-mode``); ``AUTO`` is resolved by the
    platform before anything runs."""

    AUTO = "auto"
    EAGER = "eager"  # plain PyTorch, no graphs
    COMPILE = "compile"  # torch.compile per bucket shape (inductor, or Gaudi's hpu_backend)
    GRAPHS = "graphs"  # captured device graphs per bucket (CUDA graphs, HPU graphs)

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class DeviceConfig:
    """Where and how the model executes."""

    device: str = flag("auto", help="auto, or a platform name: hpu, cuda, cpu or a plugin's")
    enforce_eager: bool = flag(False, help="run eagerly, no graphs or compilation (overrides "
                                                "--execution-mode)")
    execution_mode: ExecutionMode = flag(
        ExecutionMode.AUTO, help="auto: HPU/CUDA graphs on accelerators, eager on CPU (with "
                                 "the fused kernels: faster than compiled)")
    hpu_lazy_mode: bool = knob(True, env="PT_HPU_LAZY_MODE",
                               help="Gaudi: lazy mode (HPU graphs); 0: torch.compile")
    enable_sleep_mode: bool = flag(
        False, help="serve the admin endpoints POST /sleep, /wake_up, /reload_weights and GET "
                    "/is_sleeping (behind --api-key): free the weights and KV cache between "
                    "jobs, swap in new weights without a restart (see the Sleep mode page)")
    cpu_kernels: bool = knob(True, env="HPU_SERVE_CPU_KERNELS",
                             help="eager CPU: fused C++ kernels for norms, RoPE + KV writes, "
                                  "activations, paged, prefill and encoder attention, LoRA "
                                  "deltas and small-batch int4 matmuls (0: plain PyTorch "
                                  "ops, e.g. where no compiler exists)")

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "execution_mode", ExecutionMode(self.execution_mode))
        except ValueError:
            raise ValueError("--execution-mode must be auto, eager, compile or graphs") from None


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """How the model is split over devices (``--tensor-parallel-size``): one process per
    rank, rank 0 being the server itself."""

    tensor_parallel_size: int = flag(
        1, aliases=("-tp",), help="split every layer over this many devices, one process per "
                                  "rank (torch.distributed: hccl on Gaudi, nccl on CUDA, gloo "
                                  "on CPU)")
    distributed_executor_backend: str = flag(
        "mp", choices=("mp", "ray"),
        help="how the ranks run: mp (worker processes on this host) or ray (Ray actors on the "
             "Ray cluster of RAY_ADDRESS, or of this host, started if none runs; needs "
             "hpu-serve[ray])")
    collective_timeout: float = knob(
        600.0, env="HPU_SERVE_COLLECTIVE_TIMEOUT",
        help="seconds a collective may wait for a rank before failing (start-up included: a "
             "rank that compiles its graphs keeps the others waiting that long)")

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError("--tensor-parallel-size must be >= 1")
        if self.distributed_executor_backend not in ("mp", "ray"):
            raise ValueError("--distributed-executor-backend must be mp or ray")
        # checked here so that a missing optional package fails before any loading
        if (self.distributed_executor_backend == "ray" and self.tensor_parallel_size > 1
                and importlib.util.find_spec("ray") is None):
            raise ValueError("--distributed-executor-backend ray needs the ray package: "
                             "pip install 'hpu-serve[ray]'")
