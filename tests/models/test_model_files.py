"""Damaged model files end start-up with one clear line (issue 33, item 7).

Each case starts a real ``python -m server serve`` on a damaged copy of a model: a GGUF cut
in the header, in the tensor infos and in the data, with a tensor's offset beyond the file,
an unknown quantization type or a header claiming more layers than its tensors; a Hugging
Face folder whose config claims a layer the weights lack, with a tensor of the wrong shape,
a truncated shard or a shard missing. Each must exit non-zero with one ``error: model file
...`` line naming the file (and the tensor), no traceback, and a peak RSS under 1.5x that of
the valid model starting up and serving. A last test shows the mismatches are found before
the model is allocated.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from server_process import ServerProcess, free_port, wait_healthy

pytestmark = pytest.mark.slow  # make test-fast skips it; make test (CI) runs it

ROOT = Path(__file__).resolve().parents[2]
# small KV cache and few buckets: the valid reference starts quickly, and both the
# reference and the damaged copies run with the same flags
GGUF_FLAGS = ("--max-model-len", "256", "--max-num-seqs", "4", "--num-gpu-blocks-override",
              "32", "--block-size", "16")
HF_FLAGS = ("--dtype", "float32", "--block-size", "16", "--max-num-seqs", "4",
            "--num-gpu-blocks-override", "32")
RSS_FACTOR = 1.5


# Runs the server as its own child and writes the child's peak RSS (KiB, from wait4). A
# process started straight from pytest would not do: its peak counts the address space it
# was forked (or vforked) from, so pytest's own RSS.
_MEASURED = """
import os, signal, subprocess, sys
proc = subprocess.Popen(sys.argv[2:])
signal.signal(signal.SIGTERM, lambda sig, frame: proc.send_signal(sig))
_, status, usage = os.wait4(proc.pid, 0)
with open(sys.argv[1], "w") as out:
    out.write(str(usage.ru_maxrss))
sys.exit(os.waitstatus_to_exitcode(status))
"""


def _popen(model: Path, flags: tuple[str, ...], port: int, log: Path) -> subprocess.Popen:
    args = [sys.executable, "-c", _MEASURED, str(log.with_suffix(".rss")), sys.executable,
            "-m", "server", "serve", str(model), "--host", "127.0.0.1", "--port", str(port),
            *flags]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    with open(log, "w") as out:
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)


def _finish(proc: subprocess.Popen, log: Path, timeout: float) -> tuple[int, int]:
    """(exit code, peak RSS KiB) of the server once it has exited."""
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the wrapper passes it on
        proc.wait(timeout=60)
        raise
    return code, int(log.with_suffix(".rss").read_text())


def run_to_exit(model: Path, flags: tuple[str, ...], tmp: Path, timeout: float = 120.0
                ) -> tuple[int, str, int]:
    """(exit code, output, peak RSS KiB) of a server that is expected to fail at start-up."""
    log = tmp / "serve.log"
    code, rss = _finish(_popen(model, flags, free_port(), log), log, timeout)
    return code, log.read_text(errors="replace"), rss


def valid_peak_rss(model: Path, flags: tuple[str, ...], tmp: Path) -> int:
    """Peak RSS (KiB) of the valid model's server from start to serving, then drained."""
    port = free_port()
    log = tmp / "valid.log"
    proc = _popen(model, flags, port, log)
    try:
        wait_healthy(ServerProcess(proc, port, log), timeout=300)
    finally:
        proc.send_signal(signal.SIGTERM)
    code, rss = _finish(proc, log, 120)
    assert code == 0, log.read_text()
    return rss


@pytest.fixture(scope="module")
def gguf_reference(smollm2_gguf, tmp_path_factory) -> tuple[Path, int]:
    """(the embedded GGUF, the peak RSS of serving it)."""
    folder, name = smollm2_gguf
    path = Path(folder) / name
    return path, valid_peak_rss(path, GGUF_FLAGS, tmp_path_factory.mktemp("gguf-ref"))


@pytest.fixture(scope="module")
def hf_reference(tiny_model, tmp_path_factory) -> tuple[Path, int]:
    """(the tiny Llama folder, the peak RSS of serving it)."""
    path = Path(tiny_model[0])
    return path, valid_peak_rss(path, HF_FLAGS, tmp_path_factory.mktemp("hf-ref"))


def assert_one_clear_line(code: int, output: str, rss: int, reference: int,
                          *expected: str) -> str:
    """Exit non-zero, no traceback, exactly one ``error: model file`` line holding every
    ``expected`` piece, and the peak RSS bound; returns the line."""
    assert code != 0, output
    assert "Traceback" not in output, output
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, output
    line = errors[0]
    assert line.startswith("error: model file "), line
    for piece in expected:
        assert piece in line, (piece, line)
    assert rss < RSS_FACTOR * reference, (rss, reference, line)
    print(f"peak RSS {rss / 1024:.0f} MiB, valid model {reference / 1024:.0f} MiB: {line}")
    return line


# --- GGUF ---------------------------------------------------------------------------------

def _tensor_info_offsets(path: Path) -> list[tuple[str, int, int]]:
    """(name, where its info starts, where its type field starts) for each tensor, from
    the gguf library's own reader of the valid file."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    out = []
    for t in reader.tensors:
        start = t.field.offset
        type_at = start + 8 + len(t.name.encode()) + 4 + 8 * len(t.shape)
        out.append((t.name, start, type_at))
    return out


def _cut(src: Path, dst: Path, size: int) -> Path:
    with open(src, "rb") as f, open(dst, "wb") as out:
        out.write(f.read(size))
    return dst


def _patched(src: Path, dst: Path, at: int, value: bytes) -> Path:
    shutil.copyfile(src, dst)
    with open(dst, "r+b") as f:
        f.seek(at)
        f.write(value)
    return dst


GGUF_CASES: dict[str, Callable[[Path, Path], tuple[Path, tuple[str, ...]]]] = {}


def gguf_case(fn: Callable[[Path, Path], tuple[Path, tuple[str, ...]]]) -> Callable:
    GGUF_CASES[fn.__name__] = fn
    return fn


@gguf_case
def cut_in_header(valid: Path, tmp: Path) -> tuple[Path, tuple[str, ...]]:
    # 1,000 bytes: inside the metadata (the IndexError); 64 KiB likewise
    path = _cut(valid, tmp / "header.gguf", 1000)
    return path, ("truncated in the GGUF metadata", "the file has 1,000")


@gguf_case
def cut_in_tensor_infos(valid: Path, tmp: Path) -> tuple[Path, tuple[str, ...]]:
    infos = _tensor_info_offsets(valid)
    size = infos[10][1] + 5  # inside the 11th tensor's name length
    path = _cut(valid, tmp / "infos.gguf", size)
    return path, ("truncated in the GGUF tensor infos", "tensor info 11 of 272",
                  repr(infos[9][0]), f"the file has {size:,}")


@gguf_case
def cut_in_data(valid: Path, tmp: Path) -> tuple[Path, tuple[str, ...]]:
    size = valid.stat().st_size // 2  # the "cannot reshape" case
    path = _cut(valid, tmp / "data.gguf", size)
    return path, ("truncated or corrupt: tensor 'blk.", f"the file has {size:,}",
                  f"need {valid.stat().st_size:,} bytes")


@gguf_case
def offset_beyond_file(valid: Path, tmp: Path) -> tuple[Path, tuple[str, ...]]:
    name, _, type_at = _tensor_info_offsets(valid)[5]
    path = _patched(valid, tmp / "offset.gguf", type_at + 4, struct.pack("<Q", 2**40))
    return path, (f"tensor {name!r} (6 of 272", "needs bytes 1,099,",
                  f"the file has {valid.stat().st_size:,}")


@gguf_case
def header_claims_more_layers(valid: Path, tmp: Path) -> tuple[Path, tuple[str, ...]]:
    path = _patched(valid, tmp / "layers.gguf", _block_count_at(valid), struct.pack("<I", 31))
    return path, ("block_count says 31 layers", "layers 0-29 only", "first missing layers.30.")


def _block_count_at(path: Path) -> int:
    """Where the uint32 value of ``llama.block_count`` lies in the file."""
    import gguf

    field = gguf.GGUFReader(str(path)).fields["llama.block_count"]
    return field.offset + sum(part.nbytes for part in field.parts[:-1])


@gguf_case
def unknown_quantization_type(valid: Path, tmp: Path) -> tuple[Path, tuple[str, ...]]:
    name, _, type_at = _tensor_info_offsets(valid)[3]
    path = _patched(valid, tmp / "qtype.gguf", type_at, struct.pack("<I", 99))
    return path, (f"tensor {name!r}", "unknown quantization type 99")


@pytest.mark.parametrize("case", list(GGUF_CASES))
def test_damaged_gguf_fails_in_one_line(case: str, gguf_reference, tmp_path: Path) -> None:
    valid, reference = gguf_reference
    path, expected = GGUF_CASES[case](valid, tmp_path)
    code, output, rss = run_to_exit(path, GGUF_FLAGS, tmp_path)
    assert_one_clear_line(code, output, rss, reference, str(path), *expected)


# --- Hugging Face folders -------------------------------------------------------------------

def _copy_folder(src: Path, dst: Path) -> Path:
    for f in src.iterdir():
        shutil.copy(f, dst / f.name)
    return dst


def test_config_claiming_a_missing_layer(hf_reference, tmp_path: Path) -> None:
    valid, reference = hf_reference
    (tmp_path / "model").mkdir()
    folder = _copy_folder(valid, tmp_path / "model")
    config = json.loads((folder / "config.json").read_text())
    config["num_hidden_layers"] = 3  # the weights hold layers 0 and 1
    (folder / "config.json").write_text(json.dumps(config))
    code, output, rss = run_to_exit(folder, HF_FLAGS, tmp_path)
    assert_one_clear_line(code, output, rss, reference, str(folder / "config.json"),
                          "num_hidden_layers says 3 layers", "layers 0-1 only",
                          "model.layers.2.")


def test_tensor_of_the_wrong_shape(hf_reference, tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    valid, reference = hf_reference
    (tmp_path / "model").mkdir()
    folder = _copy_folder(valid, tmp_path / "model")
    (st,) = folder.glob("*.safetensors")
    tensors = load_file(st)
    name = "model.layers.1.mlp.up_proj.weight"
    rows, cols = tensors[name].shape
    tensors[name] = torch.zeros(rows - 8, cols)
    save_file(tensors, st, metadata={"format": "pt"})
    code, output, rss = run_to_exit(folder, HF_FLAGS, tmp_path)
    assert_one_clear_line(code, output, rss, reference, str(st), repr(name),
                          f"shape [{rows - 8}, {cols}]", f"calls for [{rows}, {cols}]")


def test_missing_and_truncated_shards(hf_reference, tmp_path: Path) -> None:
    valid, reference = hf_reference
    (tmp_path / "model").mkdir()
    folder = _copy_folder(valid, tmp_path / "model")
    (st,) = folder.glob("*.safetensors")
    data = st.read_bytes()
    st.write_bytes(data[: len(data) // 2])
    code, output, rss = run_to_exit(folder, HF_FLAGS, tmp_path)
    assert_one_clear_line(code, output, rss, reference, str(st), "truncated or corrupt")
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.embed_tokens.weight": "model-00002-of-00002.safetensors"}}))
    code, output, rss = run_to_exit(folder, HF_FLAGS, tmp_path)
    assert_one_clear_line(code, output, rss, reference, "model.safetensors.index.json",
                          "missing: model-00002-of-00002.safetensors")


# --- checked before the model is allocated ----------------------------------------------------

def _no_allocation(monkeypatch) -> None:
    """Allocating the model (``to_empty`` of the meta-built model) fails the test."""
    import torch

    def allocate(*args, **kwargs):
        raise AssertionError("the model was allocated before the files were checked")

    monkeypatch.setattr(torch.nn.Module, "to_empty", allocate)


def test_mismatches_are_found_before_the_model_is_allocated(
        monkeypatch, tiny_model, smollm2_gguf, tmp_path: Path) -> None:
    import torch

    from server.models.errors import ModelFileError
    from server.models.loader import load_model, resolve_model_source

    (tmp_path / "model").mkdir()
    folder = _copy_folder(Path(tiny_model[0]), tmp_path / "model")
    config = json.loads((folder / "config.json").read_text())
    config["num_hidden_layers"] = 3
    (folder / "config.json").write_text(json.dumps(config))
    layers = _patched(Path(*smollm2_gguf), tmp_path / "layers.gguf",
                      _block_count_at(Path(*smollm2_gguf)), struct.pack("<I", 31))
    _no_allocation(monkeypatch)
    for model, what in ((folder, "num_hidden_layers says 3"), (layers, "block_count says 31")):
        with pytest.raises(ModelFileError, match=what):
            load_model(resolve_model_source(str(model)), "float32", torch.device("cpu"))
