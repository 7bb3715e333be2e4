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


# --- 2 MiB pages for what every decode step streams -------------------------------------

def _thp_mode() -> str:
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return "none"
    return text.split("[", 1)[1].split("]", 1)[0]


needs_thp = pytest.mark.skipif(_thp_mode() not in ("always", "madvise"),
                               reason="transparent huge pages are off on this host")


def smaps_line(address: int, field: str) -> list[str]:
    """The values of ``field`` (e.g. ``AnonHugePages:``) for the mapping that holds
    ``address`` in /proc/self/smaps; [] when there is none."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == field:
                return line.split()[1:]
    return []


def huge_kib_at(address: int) -> int:
    """AnonHugePages of the mapping that holds ``address``."""
    value = smaps_line(address, "AnonHugePages:")
    return int(value[0]) if value else 0


def advised_at(address: int) -> bool:
    """Whether the mapping that holds ``address`` carries MADV_HUGEPAGE (VmFlags "hg")."""
    return "hg" in smaps_line(address, "VmFlags:")


@needs_thp
def test_packed_weights_live_on_huge_pages() -> None:
    import torch

    from server.hpu.cpu.bf16_pack import pack_bf16
    from server.hpu.cpu.host_memory import HugePageArena

    packed = pack_bf16(torch.randn(2048, 1024))  # 4 MiB: at least one whole 2 MiB page
    assert huge_kib_at(packed.weight.data_ptr()) >= 2048

    arena = HugePageArena(chunk_bytes=8 << 20)
    assert huge_kib_at(arena.copy(torch.ones(1 << 20)).data_ptr()) >= 2048


@needs_thp
def test_cpu_kv_cache_is_advised_before_its_zero_fill() -> None:
    import torch

    from server.hpu.kv_cache import KVCacheLayout

    # 34 MiB a tensor: past glibc's largest mmap threshold, so fresh pages, as a served
    # cache's are (the default 4 GiB over SmolLM2's 60 tensors: 68 MiB each)
    (k, v), = KVCacheLayout(1, 2, 64).allocate(1087, 128, torch.bfloat16,
                                               torch.device("cpu"))
    assert k.shape == (1088, 2, 128, 64) and not k.any() and not v.any()
    for t in (k, v):  # mid-tensor: the parts before its first 2 MiB boundary and after
        # its last keep 4 KiB pages
        assert huge_kib_at(t.data_ptr() + t.numel() * t.element_size() // 2) >= 2048


def test_arena_copies_are_equal_views_that_keep_their_chunk() -> None:
    import gc

    import torch

    from server.hpu.cpu.host_memory import HugePageArena

    arena = HugePageArena(chunk_bytes=1 << 20)
    a = torch.arange(1000, dtype=torch.int16).view(10, 100)
    b = torch.randn(33, 7).t()  # not contiguous: copied contiguous
    ca, cb = arena.copy(a), arena.copy(b)
    assert torch.equal(ca, a) and torch.equal(cb, b) and cb.is_contiguous()
    assert ca.untyped_storage().data_ptr() == cb.untyped_storage().data_ptr()  # one chunk
    assert cb.data_ptr() % HugePageArena.ALIGN == 0
    big = arena.copy(torch.ones(2 << 20, dtype=torch.uint8))  # past the chunk: its own
    assert big.untyped_storage().data_ptr() != ca.untyped_storage().data_ptr()
    assert arena.copy(torch.empty(0, 3)).shape == (0, 3)
    del arena, a
    gc.collect()
    assert ca.sum().item() == sum(range(1000))  # the copies keep their chunk alive


@needs_thp
def test_kv_cache_woken_from_sleep_is_on_huge_pages_again() -> None:
    import torch
    from torch import nn

    from server.engine.worker.sleep import DeviceMemory
    from server.hpu.kv_cache import KVCacheLayout

    caches = KVCacheLayout(1, 2, 64).allocate(1087, 128, torch.bfloat16, torch.device("cpu"))
    memory = DeviceMemory(nn.Module(), caches, False, torch.device("cpu"))
    memory.release_kv()
    memory.restore_kv()
    k = caches[0][0]
    assert not k.any() and huge_kib_at(k.data_ptr() + k.numel() * k.element_size() // 2) >= 2048


@needs_thp
def test_onednn_packed_weight_is_advised_huge_pages() -> None:
    import torch
    from torch import nn

    from server.hpu.cpu.linear import PackedLinear, packing_supported

    if not packing_supported(torch.float32):
        pytest.skip("no oneDNN")
    dense = nn.Linear(2048, 1024, bias=False)
    layer = PackedLinear(dense)  # 8 MiB, placed by oneDNN
    x = torch.randn(3, 2048)
    torch.testing.assert_close(layer(x), dense(x))
    address = torch.ops.mkldnn.data_ptr(layer.packed_weight)
    # advised, for khugepaged to move in the background (collapsing at once cost start-up)
    assert advised_at(address + torch.ops.mkldnn._nbytes(layer.packed_weight) // 2)
