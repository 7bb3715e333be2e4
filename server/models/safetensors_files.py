"""A Hugging Face folder's safetensors shards: which files, their tensors (whole, lazily
sliceable, or as shapes only), and a damaged or missing shard named in one line.

safetensors checks on open that its header covers the file exactly, so a truncated or
corrupt shard fails there, before any tensor is read.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from server.models.errors import MissingModelFileError, model_file_error

# safetensors' dtype names -> torch's, for shape-only (meta) tensors
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
    "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
    "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


def safetensors_files(folder: Path) -> list[Path]:
    """The checkpoint's shards: those ``model.safetensors.index.json`` lists when there is
    one (repositories also ship other copies, such as Mistral's ``consolidated.safetensors``,
    which would load every weight twice), else every ``*.safetensors`` file."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
        except (ValueError, AttributeError) as exc:
            raise model_file_error(index, f"not a valid index ({exc})") from None
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise MissingModelFileError(f"model file {index}: shards it lists are missing: "
                                        f"{', '.join(missing[:4])}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise MissingModelFileError(f"model folder {folder}: no *.safetensors files")
    return files


def _open(path: Path) -> Any:
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as exc:
        raise model_file_error(path, f"truncated or corrupt safetensors file ({exc})") from None


def _keys(folder: Path, desc: str | None) -> Iterator[tuple[Any, str, Path]]:
    files = safetensors_files(folder)
    handles = [(_open(f), f) for f in files]
    keys = [(h, k, f) for h, f in handles for k in h.keys()]
    # disable=None: no bar unless stderr is a terminal (a log file or pipeline gets none)
    return iter(keys) if desc is None else tqdm(keys, desc=desc, unit="tensor", leave=False,
                                                disable=None)


def safetensors_tensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) for every tensor of every shard."""
    for handle, key, _ in _keys(folder, "Loading safetensors"):
        yield key, handle.get_tensor(key)


def safetensors_slices(folder: Path) -> Iterator[tuple[str, object]]:
    """Like ``safetensors_tensors`` but lazily indexable tensors (``get_slice``)."""
    for handle, key, _ in _keys(folder, "Loading safetensors"):
        yield key, handle.get_slice(key)


def safetensors_shapes(folder: Path, origin: dict[str, str]
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor as a meta tensor of its shape and dtype, read from the shards' headers
    only; ``origin`` collects the shard each name comes from (for error messages)."""
    for handle, key, path in _keys(folder, None):
        sliced = handle.get_slice(key)
        dtype = _DTYPES.get(sliced.get_dtype())
        if dtype is None:
            raise model_file_error(path, f"tensor {key!r} has dtype {sliced.get_dtype()}, "
                                   "which this server does not load")
        origin[key] = str(path)
        yield key, torch.empty(sliced.get_shape(), dtype=dtype, device="meta")
