"""``vllm serve`` flags that mean nothing here, accepted so that a vLLM deployment's command
line runs as it is. Each help text says why it has no effect; setting one logs that line once.

A flag that would change what the server answers is not listed here: unknown to the parser,
it stops start-up with argparse's error naming it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from server.config.fields import flag, spec_of

GROUP = "vLLM flags with no effect here (accepted, with a warning when set)"


@dataclass(frozen=True, slots=True)
class VllmNoOpFlags:
    """Accepted for a drop-in command line; none changes what the server does."""

    trust_remote_code: bool = flag(
        False, group=GROUP,
        help="no model code is ever downloaded or run: every architecture is built in")
    swap_space: float = flag(
        4.0, group=GROUP,
        help="GiB of host swap for preempted sequences: they are recomputed here, never "
             "swapped")
    load_format: str = flag(
        "auto", group=GROUP, choices=("auto", "safetensors", "gguf"),
        help="the format is read from the model's files")
    tokenizer_mode: str = flag(
        "auto", group=GROUP, choices=("auto", "hf"),
        help="the model's own Hugging Face tokenizer (or the GGUF's) is used")
    disable_custom_all_reduce: bool = flag(
        False, group=GROUP, help="collectives are torch.distributed's (hccl, nccl, gloo)")
    max_seq_len_to_capture: int | None = flag(
        None, group=GROUP,
        help="graphs cover the planned buckets (VLLM_*_BUCKET_* and --max-model-len)")
    disable_frontend_multiprocessing: bool = flag(
        False, group=GROUP, help="the API server and the engine share one process already")
    max_parallel_loading_workers: int | None = flag(
        None, group=GROUP, help="each rank loads its own weights")
    show_hidden_metrics_for_version: str | None = flag(
        None, group=GROUP,
        help="vLLM re-shows metrics it deprecated in that version; no metric here is hidden")


def ignored_flags(flags: VllmNoOpFlags) -> list[str]:
    """One line for each of these flags set away from its default: what it would do in vLLM
    and why it does nothing here."""
    lines = []
    for f in dataclasses.fields(flags):
        value = getattr(flags, f.name)
        spec = spec_of(f)
        if spec is not None and value != f.default:
            lines.append(f"--{spec.flag_name(f.name)} {value} has no effect here: {spec.help}")
    return lines
