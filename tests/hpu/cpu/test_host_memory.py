"""The CPU allocator tuning keeps a step's freed temporaries in the heap for the next step."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = """
import ctypes, sys, torch
from server.hpu.cpu.host_memory import tune_host_allocator

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
if sys.argv[1] == "tuned":
    assert tune_host_allocator()
x = torch.ones(4_000_000)  # 16 MB
y = x * 2                  # a 16 MB temporary, like a gathered KV or an activation
del y
print(libc.mallinfo2().fordblks)  # bytes free but kept in the heap
"""


def free_heap_bytes(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True,
                         check=True)
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_tuned_allocator_keeps_freed_temporaries() -> None:
    # glibc by default hands a fresh 16 MB block back to the kernel on free (mmap/munmap), so
    # the next step maps and zero-fills it again; tuned, it stays in the heap for reuse.
    assert free_heap_bytes("default") < 4_000_000
    assert free_heap_bytes("tuned") >= 16_000_000
