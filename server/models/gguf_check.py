"""A GGUF file's layout checked against its size before anything reads a tensor.

The header (magic, version, counts), every metadata entry and tensor info, the alignment,
and each tensor's type, shape and byte range are walked with the file's size in hand, so a
truncated download or a corrupt file fails with one line naming the file, the first bad
tensor and the bytes expected vs found, rather than a numpy error deep in the loader.

Only the header is read (through mmap: the pages of the metadata, a few MB for a 49k-token
vocabulary), never tensor data. The layout is the GGUF spec's (versions 2 and 3): counts and
lengths are uint64, a tensor info is name, n_dims, dims (innermost first), type, offset from
the data section, which starts at the end of the infos rounded up to ``general.alignment``.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import mmap
import os
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
from gguf.constants import (
    GGML_QUANT_SIZES,
    GGUF_DEFAULT_ALIGNMENT,
    GGMLQuantizationType,
    GGUFValueType,
)

from server.models.errors import ModelFileError, model_file_error

Fail = Callable[[str], ModelFileError]  # a message -> the error naming the file

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_FIXED_HEADER = 24  # magic, version, tensor count, metadata count
_MAX_DIMS = 4  # GGML_MAX_DIMS
_SCALAR_SIZES = {
    GGUFValueType.UINT8: 1, GGUFValueType.INT8: 1, GGUFValueType.BOOL: 1,
    GGUFValueType.UINT16: 2, GGUFValueType.INT16: 2,
    GGUFValueType.UINT32: 4, GGUFValueType.INT32: 4, GGUFValueType.FLOAT32: 4,
    GGUFValueType.UINT64: 8, GGUFValueType.INT64: 8, GGUFValueType.FLOAT64: 8,
}
_INT_FORMATS = {GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b",
                GGUFValueType.UINT16: "H", GGUFValueType.INT16: "h",
                GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i",
                GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q"}


class _Cut(Exception):
    """The walk needs the bytes up to ``end`` and the file is shorter."""

    def __init__(self, end: int) -> None:
        super().__init__(end)
        self.end = end


class _Corrupt(Exception):
    """A value no GGUF writer produces (an unknown value type, too many dims)."""


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor as the header describes it; ``start`` / ``end`` are file positions."""

    name: str
    dims: tuple[int, ...]  # GGUF order: dims[0] is the row length
    qtype: GGMLQuantizationType
    start: int
    end: int


class _Cursor:
    """Reads the header front to back, raising ``_Cut`` at the first byte past the end."""

    def __init__(self, buf: mmap.mmap, size: int, order: str) -> None:
        self.buf, self.size, self.order, self.pos = buf, size, order, 0

    def take(self, n: int) -> int:
        """Steps over ``n`` bytes; returns where they start."""
        start = self.pos
        if start + n > self.size:
            raise _Cut(start + n)
        self.pos = start + n
        return start

    def unpack(self, fmt: str) -> int:
        return struct.unpack_from(self.order + fmt, self.buf, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.unpack("Q")
        start = self.take(n)
        return self.buf[start:start + n].decode("utf-8", errors="replace")

    def value(self, vtype: int) -> int | None:
        """Steps over one metadata value; returns it when it is an integer (the alignment)."""
        if vtype in _INT_FORMATS:
            return self.unpack(_INT_FORMATS[GGUFValueType(vtype)])
        if vtype in _SCALAR_SIZES:
            self.take(_SCALAR_SIZES[GGUFValueType(vtype)])
        elif vtype == GGUFValueType.STRING:
            self.take(self.unpack("Q"))
        elif vtype == GGUFValueType.ARRAY:
            item, count = self.unpack("I"), self.unpack("Q")
            if item in _SCALAR_SIZES:
                self.take(count * _SCALAR_SIZES[GGUFValueType(item)])
            elif item == GGUFValueType.STRING:
                self._strings(count)
            elif item == GGUFValueType.ARRAY:
                for _ in range(count):
                    self.value(item)
            else:
                raise _Corrupt(f"unknown array item type {item}")
        else:
            raise _Corrupt(f"unknown value type {vtype}")
        return None

    def _strings(self, count: int) -> None:
        # a vocabulary is ~100k strings: one tight loop rather than a call per string
        buf, size, fmt, pos = self.buf, self.size, self.order + "Q", self.pos
        for _ in range(count):
            if pos + 8 > size:
                raise _Cut(pos + 8)
            pos += 8 + struct.unpack_from(fmt, buf, pos)[0]
            if pos > size:
                raise _Cut(pos)
        self.pos = pos


def check_gguf(path: str) -> list[TensorInfo]:
    """Every tensor's place in the file, once the whole layout fits the file's size;
    raises ``ModelFileError`` (file, tensor, bytes expected vs found) otherwise."""
    with _mapped(path) as (buf, size):
        return _walk(path, buf, size)


def metadata_digest(path: str) -> str:
    """sha256 of the file's header and metadata entries (vocabulary, chat template,
    architecture keys), not of its tensors: copies of one file digest alike, and so do
    files that differ in their weights alone. Raises ``ModelFileError`` as the check does."""
    with _mapped(path) as (buf, size):
        cur = _metadata_walk(path, buf, size)[0]
        return hashlib.sha256(buf[:cur.pos]).hexdigest()


@contextlib.contextmanager
def _mapped(path: str) -> Iterator[tuple[mmap.mmap, int]]:
    """The file mapped read-only, with its size (one that cannot hold a magic fails)."""
    size = os.path.getsize(path)
    if size < len(_MAGIC):
        raise model_file_error(path, f"truncated: {size} bytes, not even a GGUF header")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        yield buf, size


def _walk(path: str, buf: mmap.mmap, size: int) -> list[TensorInfo]:
    cur, n_tensors, alignment, fail = _metadata_walk(path, buf, size)
    infos = _tensor_infos(cur, n_tensors, fail)
    if alignment <= 0 or alignment & (alignment - 1):
        raise fail(f"corrupt: general.alignment {alignment} is not a power of two")
    data_start = -(-cur.pos // alignment) * alignment
    return _placed(infos, data_start, alignment, size, fail)


def _metadata_walk(path: str, buf: mmap.mmap, size: int) -> tuple[_Cursor, int, int, Fail]:
    """The header and metadata entries walked: (the cursor past them, the tensor count,
    the alignment, the failure maker)."""
    def fail(what: str) -> ModelFileError:
        return model_file_error(path, what)

    if buf[:4] != _MAGIC:
        raise fail(f"not a GGUF file (it starts with {bytes(buf[:4])!r}, not {_MAGIC!r})")
    if size < _FIXED_HEADER:
        raise fail(f"truncated in the GGUF header: {size} bytes, the fixed header alone "
                   f"is {_FIXED_HEADER}")
    order = "<"
    version = struct.unpack_from("<I", buf, 4)[0]
    if version & 0xFFFF == 0:  # a big-endian file, as GGUFReader detects it
        order, version = ">", struct.unpack_from(">I", buf, 4)[0]
    if version not in _VERSIONS:
        raise fail(f"GGUF version {version} is not supported (2 or 3)")
    cur = _Cursor(buf, size, order)
    cur.pos = 8
    n_tensors, n_entries = cur.unpack("Q"), cur.unpack("Q")
    return cur, n_tensors, _metadata(cur, n_entries, fail), fail


def _short(cut: _Cut, size: int) -> str:
    return f"it needs at least {cut.end:,} bytes, the file has {size:,}"


def _metadata(cur: _Cursor, count: int, fail: Fail) -> int:
    """Steps over the metadata entries; returns the alignment (the spec's default of 32
    unless ``general.alignment`` says otherwise)."""
    alignment = GGUF_DEFAULT_ALIGNMENT
    key = None
    for i in range(count):
        previous, key = key, None
        try:
            key = cur.string()
            value = cur.value(cur.unpack("I"))
        except _Cut as cut:
            named = (f", key {key!r}" if key is not None
                     else f", after key {previous!r}" if previous is not None else "")
            raise fail(f"truncated in the GGUF metadata (entry {i + 1:,} of {count:,}{named}): "
                       f"{_short(cut, cur.size)}") from None
        except _Corrupt as exc:
            raise fail(f"corrupt GGUF metadata entry {i + 1:,} of {count:,} "
                       f"(key {key!r}): {exc}") from None
        if key == "general.alignment" and value is not None:
            alignment = value
    return alignment


def _tensor_infos(cur: _Cursor, count: int, fail: Fail
                  ) -> list[tuple[str, tuple[int, ...], GGMLQuantizationType, int]]:
    """(name, dims, type, offset) of each tensor, types and shapes checked."""
    infos: list[tuple[str, tuple[int, ...], GGMLQuantizationType, int]] = []
    seen: set[str] = set()
    for i in range(count):
        where = f"tensor info {i + 1:,} of {count:,}"
        name = None
        try:
            name = cur.string()
            n_dims = cur.unpack("I")
            if not 0 < n_dims <= _MAX_DIMS:
                raise _Corrupt(f"{n_dims} dimensions (at most {_MAX_DIMS})")
            dims = tuple(cur.unpack("Q") for _ in range(n_dims))
            raw_type, offset = cur.unpack("I"), cur.unpack("Q")
        except _Cut as cut:
            after = f", after {infos[-1][0]!r}" if infos and name is None else ""
            named = f", {name!r}" if name is not None else ""
            raise fail(f"truncated in the GGUF tensor infos ({where}{named}{after}): "
                       f"{_short(cut, cur.size)}") from None
        except _Corrupt as exc:
            raise fail(f"corrupt GGUF tensor info ({where}, {name!r}): {exc}") from None
        if name in seen:
            raise fail(f"corrupt: tensor {name!r} appears twice ({where})")
        seen.add(name)
        infos.append((name, dims, _tensor_type(name, raw_type, dims, where, fail), offset))
    return infos


def _tensor_type(name: str, raw: int, dims: tuple[int, ...], where: str, fail: Fail
                 ) -> GGMLQuantizationType:
    """The tensor's type, if it is one this server can dequantize and its rows hold whole
    blocks of it."""
    try:
        qtype = GGMLQuantizationType(raw)
    except ValueError:
        raise fail(f"tensor {name!r} ({where}) has unknown quantization type {raw}: "
                   "corrupt, or written by a newer llama.cpp than this server's gguf "
                   "library knows") from None
    if qtype not in GGML_QUANT_SIZES or not _dequantizable(qtype):
        raise fail(f"tensor {name!r} ({where}) has quantization type {qtype.name} ({raw}), "
                   "which this server cannot dequantize")
    block = GGML_QUANT_SIZES[qtype][0]
    if dims[0] % block:
        raise fail(f"corrupt: tensor {name!r} ({where}) has rows of {dims[0]} values, not "
                   f"a multiple of {qtype.name}'s block of {block}")
    return qtype


@functools.cache
def _dequantizable(qtype: GGMLQuantizationType) -> bool:
    """Whether the gguf library dequantizes this type (it lists types it cannot: the
    integer ones, retired formats), probed on one zero block."""
    from gguf import quants

    try:
        quants.dequantize(np.zeros((1, GGML_QUANT_SIZES[qtype][1]), np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def _placed(infos: list[tuple[str, tuple[int, ...], GGMLQuantizationType, int]],
            data_start: int, alignment: int, size: int, fail: Fail) -> list[TensorInfo]:
    """Each tensor's byte range, all of them inside the file and none overlapping."""
    placed = []
    for name, dims, qtype, offset in infos:
        if offset % alignment:
            raise fail(f"corrupt: tensor {name!r} starts at data offset {offset:,}, not a "
                       f"multiple of the alignment {alignment}")
        block, type_size = GGML_QUANT_SIZES[qtype]
        start = data_start + offset
        placed.append(TensorInfo(name, dims, qtype, start,
                                 start + int(np.prod(dims, dtype=object)) // block * type_size))
    expected = max((t.end for t in placed), default=data_start)
    for i, t in enumerate(placed):
        if t.end > size:
            shape = "x".join(str(d) for d in reversed(t.dims))
            raise fail(f"truncated or corrupt: tensor {t.name!r} ({i + 1:,} of {len(placed):,}, "
                       f"{t.qtype.name} {shape}) needs bytes {t.start:,} to {t.end:,}, the file "
                       f"has {size:,} (its tensors need {expected:,} bytes)")
    ordered = sorted(placed, key=lambda t: t.start)
    for a, b in zip(ordered, ordered[1:]):
        if b.start < a.end:
            raise fail(f"corrupt: tensors {a.name!r} and {b.name!r} overlap (bytes "
                       f"{b.start:,} to {a.end:,})")
    return placed
