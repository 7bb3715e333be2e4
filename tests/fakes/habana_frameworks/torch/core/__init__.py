"""``habana_frameworks.torch.core``: ``mark_step`` ends a lazy-mode graph and runs it."""

from __future__ import annotations

from habana_frameworks import standin


def _reference_mark_step(device_str="", sync=False):  # noqa: ANN001, ANN202 - the bridge's
    ...


@standin.documented("core.mark_step", _reference_mark_step)
def mark_step(device_str: str = "", sync: bool = False) -> None:
    """Flushes the ops accumulated since the last call. The bridge decorates it
    ``@lazy_only``: in eager mode (``PT_HPU_LAZY_MODE=0``) calling it is a mistake, which the
    stand-in makes loud."""
    if not standin.LAZY:
        raise RuntimeError("mark_step is lazy-mode only (PT_HPU_LAZY_MODE=0 is set)")
    standin.state["pending_forwards"] = 0
