"""Where start-up keeps what it builds once and reuses on restarts: the fused CPU kernels
and GGUF tokenizers converted to Hugging Face files."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def writable_cache_dir(requested: str | Path | None = None) -> Path:
    """``requested`` (``HPU_SERVE_CACHE_DIR``), else ``~/.cache/hpu-serve``, else a temp
    dir: the first writable one (a read-only home in a container must not stop the server)."""
    for candidate in ([Path(requested)] if requested else []) + [
            Path.home() / ".cache" / "hpu-serve",
            Path(tempfile.gettempdir()) / "hpu-serve-cache"]:
        try:
            candidate.mkdir(parents=True, exist_ok=True)
            if os.access(candidate, os.W_OK):
                return candidate
        except OSError:
            continue
    raise OSError("no writable cache directory (set HPU_SERVE_CACHE_DIR)")
