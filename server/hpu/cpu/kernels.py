"""Builds and loads the fused CPU kernels (``csrc/*.cpp``) as ``torch.ops.hpu_serve``.

The kernels are compiled once per machine with the host C++ compiler and ``-march=native``;
the shared library is cached under a name derived from the source, the flags, the torch
version and the CPU's instruction-set flags, so a cache volume moved to another CPU model
rebuilds instead of hitting an illegal instruction. Plain compiler calls (one per source, in
parallel, then a link), no ninja, no lock file: concurrent first starts each build to
private temp files and rename the library into place, so a crashed build can never leave a
later start waiting. Building takes ~110 s of CPU time (the sources compiled in parallel:
about a minute on 2 idle cores, one instantiation per dtype, head size and group count of
the attention fast paths); loading a cached build is instant. Without a compiler the engine keeps the pure
PyTorch ops, which compute the same values.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = (CSRC / "layer_kernels.cpp", CSRC / "paged_attention.cpp",
           CSRC / "paged_attention_fp8.cpp", CSRC / "lora_kernels.cpp",
           CSRC / "encoder_attention.cpp", CSRC / "prefill_attention.cpp",
           CSRC / "int4_gemm.cpp", CSRC / "bf16_gemm.cpp", CSRC / "q8_gemm.cpp",
           CSRC / "decode_stack.cpp")
HEADERS = (CSRC / "kernel_utils.h", CSRC / "attention_common.h", CSRC / "paged_attention.h",
           CSRC / "decode_head_bf16.h")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math",
         "-DNDEBUG", "-std=c++17", "-fPIC")
_lock = threading.Lock()
_loaded: dict[str, bool] = {}


def _cpu_fingerprint() -> str:
    """What the build is specific to (Linux: the CPU's feature flags)."""
    text = platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                text += line
                break
    except OSError:
        pass
    return text


def library_path(cache_dir: Path) -> Path:
    """Where the build for this source, torch, compiler flags and CPU lives."""
    key = hashlib.sha256()
    for part in (*(p.read_bytes() for p in SOURCES + HEADERS), " ".join(FLAGS).encode(),
                 torch.__version__.encode(), _cpu_fingerprint().encode()):
        key.update(part)
    return cache_dir / f"hpu_serve_cpu_kernels-{key.hexdigest()[:16]}.so"


def compile_command(compiler: str, source: Path, output: Path) -> list[str]:
    from torch.utils.cpp_extension import include_paths

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [compiler, *FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            *(f"-I{p}" for p in include_paths()), "-c", str(source), "-o", str(output)]


def link_command(compiler: str, objects: list[Path], output: Path) -> list[str]:
    from torch.utils.cpp_extension import library_paths

    libs = library_paths()
    return [compiler, "-shared", "-fopenmp", *map(str, objects), "-o", str(output),
            *(f"-L{p}" for p in libs), *(f"-Wl,-rpath,{p}" for p in libs),
            "-lc10", "-ltorch_cpu", "-ltorch"]


def kernels_available() -> bool:
    """True once the ops are registered in this process."""
    return hasattr(torch.ops, "hpu_serve") and hasattr(torch.ops.hpu_serve, "decode_attention")


def _register_fakes() -> None:
    """Shape-only kernels of the ops a compiled graph may call, so that torch.compile
    traces them as opaque calls (the LoRA op: it writes ``y`` in place, returns nothing)."""
    if hasattr(torch.ops.hpu_serve, "lora_add_"):
        torch.library.register_fake("hpu_serve::lora_add_")(_lora_add_fake)
    if hasattr(torch.ops.hpu_serve, "prefill_attention"):
        torch.library.register_fake("hpu_serve::prefill_attention")(_prefill_attention_fake)


def _lora_add_fake(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor,
                   slot: torch.Tensor, parts: list[int]) -> None:
    del y, x, a, bt, slot, parts


def _prefill_attention_fake(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                            min_run: int = 16) -> torch.Tensor:
    del k_cache, v_cache, block_tables, seq_lens, scale, min_run
    return query.new_empty(query.shape)


def load_cpu_kernels(cache_dir: str | Path) -> bool:
    """Builds (first time for this machine and source) into ``cache_dir`` and registers the
    kernels; False, with the reason logged, where that is impossible (no compiler, a failed
    build)."""
    with _lock:
        if "done" in _loaded:
            return _loaded["done"]
        try:
            directory = Path(cache_dir)
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            logger.warning("Fused CPU kernels unavailable (cache directory: %s)", exc)
            directory = None
        _loaded["done"] = ok = directory is not None and _load(directory)
        return ok


def _load(cache_dir: Path) -> bool:
    try:
        path = library_path(cache_dir)
        if not path.exists():
            compiler = shutil.which("c++") or shutil.which("g++")
            if compiler is None:
                logger.warning("Fused CPU kernels unavailable (no C++ compiler): using "
                               "PyTorch ops, same results, slower small batches")
                return False
            logger.info("Building fused CPU kernels into %s (once per machine)", path)
            start = time.monotonic()
            error = _build(compiler, path)
            if error:
                logger.warning("Fused CPU kernels failed to build, using PyTorch ops:\n%s",
                               error[-2000:])
                return False
            logger.info("Fused CPU kernels built in %.1f s", time.monotonic() - start)
        torch.ops.load_library(str(path))
        _register_fakes()
        return kernels_available()
    except (OSError, RuntimeError) as exc:
        logger.warning("Fused CPU kernels unavailable, using PyTorch ops: %s", exc)
        return False


def _build(compiler: str, path: Path) -> str:
    """Compiles the sources in parallel and links them into ``path``; the compiler's
    errors, or "" on success."""
    with tempfile.TemporaryDirectory(prefix=".build-", dir=path.parent) as tmp:
        objects = [Path(tmp, f"{source.stem}.o") for source in SOURCES]
        jobs = [subprocess.Popen(compile_command(compiler, source, obj), stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)
                for source, obj in zip(SOURCES, objects)]
        outputs = [job.communicate()[0] for job in jobs]
        if any(job.returncode != 0 for job in jobs):
            return "\n".join(outputs)
        library = Path(tmp, path.name)
        linked = subprocess.run(link_command(compiler, objects, library), capture_output=True,
                                text=True, check=False)
        if linked.returncode != 0:
            return linked.stdout + linked.stderr
        os.replace(library, path)  # atomic: a concurrent start sees the old state or this
    return ""
