"""Host (CPU) allocator tuning for serving from host memory.

A decode step allocates and frees the same multi-megabyte temporaries (gathered KV blocks,
MLP activations, logits) every layer of every step. glibc serves allocations above its mmap
threshold with fresh ``mmap`` pages and returns them with ``munmap`` on free, so every step
pays a page fault per 4 KiB touched: measured here, a 4.7 MiB gather took 5x longer into fresh
pages than into reused ones, and decode at batch 32 ran ~20% slower. Raising the mmap and
trim thresholds keeps freed memory in the heap for the next step to reuse.

Weights streamed every step (the small-batch kernels' packed copies) and KV caches also ask
for 2 MiB pages: on 4 KiB pages a decode step's reads cross a page, and miss the TLB, every
64 cache lines, and the hardware prefetcher stops at each crossing. Measured on this pool's
EPYC (2 threads, the bf16 kernel on 256 MB of weights): 21-25 GB/s on 4 KiB pages against
29-38 GB/s on 2 MiB ones.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import logging
import sys
import threading
from collections.abc import Iterator

import torch

logger = logging.getLogger(__name__)

# mallopt parameters from glibc's malloc.h
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
# glibc caps the mmap threshold at 32 MiB on 64-bit (HEAP_MAX / 2 of DEFAULT_MMAP_THRESHOLD_MAX)
MMAP_THRESHOLD = 32 * 1024 * 1024
TRIM_THRESHOLD = 1024 * 1024 * 1024
TOP_PAD = 64 * 1024 * 1024

_tuned = False

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # linux/mman.h
_MADV_COLLAPSE = 25
ARENA_CHUNK = 64 << 20  # packed weights per chunk of the arena below


def tune_host_allocator() -> bool:
    """Applies the thresholds once per process; False where libc is not glibc."""
    global _tuned
    if _tuned:
        return True
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl, macOS: no mallopt, nothing to tune
        return False
    ok = all(mallopt(param, value) == 1 for param, value in (
        (_M_MMAP_THRESHOLD, MMAP_THRESHOLD),
        (_M_TRIM_THRESHOLD, TRIM_THRESHOLD),
        (_M_TOP_PAD, TOP_PAD),
    ))
    _tuned = ok
    if ok:
        logger.info("Host allocator: mmap threshold %d MiB, trim threshold %d MiB",
                    MMAP_THRESHOLD >> 20, TRIM_THRESHOLD >> 20)
    return ok


@contextlib.contextmanager
def returning_freed_memory() -> Iterator[None]:
    """Memory freed inside goes back to the system (sleep mode frees whole KV caches and
    weights). ``malloc_trim`` alone leaves the free top of a thread's heap mapped (only the
    main heap's top is trimmed), and the raised trim threshold and top pad keep it there;
    lowered while the tensors are freed, glibc unmaps those tops as it frees."""
    libc = _libc()
    lowered = _tuned and libc is not None
    if lowered:
        libc.mallopt(_M_TRIM_THRESHOLD, 128 * 1024)
        libc.mallopt(_M_TOP_PAD, 0)
    try:
        yield
    finally:
        if lowered:
            libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
            libc.mallopt(_M_TOP_PAD, TOP_PAD)
        release_free_host_memory()


@functools.cache
def _libc() -> ctypes.CDLL | None:
    # once per process: find_library runs ldconfig, and every madvise of a start-up asked
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt  # noqa: B018 - glibc only (musl, macOS: none)
    except (OSError, AttributeError):
        return None
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def release_free_host_memory() -> bool:
    """Hands the heap's free pages back to the system (glibc ``malloc_trim``): with the
    trim threshold raised above, freed tensors stay mapped otherwise. False where libc has
    no ``malloc_trim``."""
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    trim(0)
    return True


def _madvise_whole_pages(t: torch.Tensor | torch.UntypedStorage, advice: int) -> bool:
    if t.device.type != "cpu":
        return False
    start = t.data_ptr()
    end = start + (t.nbytes() if isinstance(t, torch.UntypedStorage)
                   else t.numel() * t.element_size())
    return _madvise(-(-start // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE, advice)


def _madvise(first: int, last: int, advice: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    libc = _libc()
    if last <= first or libc is None:
        return False
    return libc.madvise(first, last - first, advice) == 0


def advise_huge_pages(t: torch.Tensor | torch.UntypedStorage) -> bool:
    """Asks Linux to back the whole 2 MiB pages inside ``t``'s bytes with huge pages
    (``madvise(MADV_HUGEPAGE)``). Only pages not touched yet get them at their first write;
    see ``collapse_huge_pages`` for the others. False where nothing was advised: not Linux,
    no 2 MiB page inside, or transparent huge pages off."""
    return _madvise_whole_pages(t, _MADV_HUGEPAGE)


def collapse_huge_pages(t: torch.Tensor | torch.UntypedStorage) -> bool:
    """Moves the whole 2 MiB pages inside ``t``'s bytes that are on 4 KiB pages now onto huge
    ones (``MADV_COLLAPSE``, Linux 6.1+; synchronous, contents kept). For memory the
    allocator hands out from its heap, touched before: advising it alone changes nothing.
    False where nothing was collapsed (older kernels, THP off, no whole page inside)."""
    return _madvise_whole_pages(t, _MADV_COLLAPSE)


def advise_around(address: int, nbytes: int) -> bool:
    """``MADV_HUGEPAGE`` on every 2 MiB page that ``[address, address + nbytes)`` touches, for
    memory a library placed and filled (oneDNN's packed weights; a weight of 1 MiB shares its
    pages with its heap neighbours). The kernel's khugepaged then moves them to huge pages in
    the background: collapsing them at once cost a GGUF engine's start-up ~1 s (120 weights),
    which every test that builds an engine paid too."""
    if nbytes <= 0:
        return False
    return _madvise(address // HUGE_PAGE * HUGE_PAGE,
                    -(-(address + nbytes) // HUGE_PAGE) * HUGE_PAGE, _MADV_HUGEPAGE)


def empty_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty`` on 2 MiB pages where the host has them: advised, so fresh pages are
    huge at their first write, and collapsed, for heap memory touched before (measured in a
    served engine: 5-20% of the KV cache and packed weights came from the heap). Collapsing
    costs ~2 s per GiB that is on 4 KiB pages, ~8 ms per GiB that is not."""
    t = torch.empty(shape, dtype=dtype)
    advise_huge_pages(t)
    collapse_huge_pages(t)
    return t


class HugePageArena:
    """Copies of read-only tensors packed into 64 MiB chunks advised huge pages.

    A chunk is a plain tensor; each copy is a view of it, so a chunk is freed when its last
    copy is (a model's packed weights go with the model). Copies are never resized, which is
    why sleep mode's KV caches, resized in place, are advised in place instead."""

    ALIGN = 64  # a cache line

    def __init__(self, chunk_bytes: int = ARENA_CHUNK) -> None:
        self._chunk_bytes = chunk_bytes
        self._chunk: torch.Tensor | None = None
        self._used = self._end = 0
        self._lock = threading.Lock()

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of ``t`` in the arena."""
        nbytes = t.numel() * t.element_size()
        with self._lock:
            # a chunk sleep mode emptied (level 2) is no place for a reload's copies
            emptied = self._chunk is not None and self._chunk.untyped_storage().nbytes() == 0
            if self._chunk is None or emptied or self._used + nbytes > self._end:
                size = -(-max(self._chunk_bytes, nbytes) // HUGE_PAGE) * HUGE_PAGE
                self._chunk = empty_on_huge_pages((size + HUGE_PAGE,), torch.uint8)
                # whole 2 MiB pages only: the bytes around them keep 4 KiB ones
                self._used = -self._chunk.data_ptr() % HUGE_PAGE
                self._end = self._used + size
            start = self._used
            self._used = -(-(start + nbytes) // self.ALIGN) * self.ALIGN
            out = self._chunk[start:start + nbytes]
        out = out.view(t.dtype).view(t.shape)
        out.copy_(t)
        return out


_weights = HugePageArena()


def on_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """``t`` copied to huge pages, for weights that every decode step streams."""
    return _weights.copy(t)
