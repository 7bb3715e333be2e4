"""A model named by its Hub id loads from huggingface_hub's cache (laid out here by the test,
as huggingface_hub lays it out); without a cached copy and without the Hub the answer is one
clear line, at once. No test here reaches beyond loopback."""

from __future__ import annotations

import shutil
import socket
import time
from pathlib import Path

import openai
import pytest
from server_process import start_server

from server.config.model import HubOptions
from server.models.errors import MissingModelFileError
from server.models.hub import hub_id_of, resolve_hub_model

SHA = "0123456789abcdef0123456789abcdef01234567"
REPO = "tiny-org/tiny-llama"


def lay_out_cache(cache: Path, model_folder: str, repo: str = REPO, sha: str = SHA) -> Path:
    """models--ORG--NAME/{refs/main, snapshots/SHA/...} (the blobs indirection left out:
    huggingface_hub reads the snapshot folder's files, links or not)."""
    storage = cache / ("models--" + repo.replace("/", "--"))
    snapshot = storage / "snapshots" / sha
    shutil.copytree(model_folder, snapshot)
    (storage / "refs").mkdir(parents=True)
    (storage / "refs" / "main").write_text(sha)
    return snapshot


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens there once the socket is closed


@pytest.fixture(scope="module")
def cache(tiny_model, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hf-cache")
    lay_out_cache(root, tiny_model[0])
    return root


def test_hub_ids_and_local_paths() -> None:
    assert hub_id_of("org/name") == ("org/name", None)
    assert hub_id_of("org/name-GGUF:Q4_K_M") == ("org/name-GGUF", "Q4_K_M")
    assert hub_id_of("gpt2") == ("gpt2", None)
    assert hub_id_of("/models/x") is None and hub_id_of("a/b/c") is None
    assert hub_id_of("org/model.gguf") is None and hub_id_of("./model") is None


def test_offline_a_cached_revision_resolves_to_its_snapshot(cache) -> None:
    found = resolve_hub_model(REPO, HubOptions(download_dir=str(cache), offline=True))
    assert Path(found.path) == cache / "models--tiny-org--tiny-llama" / "snapshots" / SHA
    assert found.served_name == REPO
    by_commit = resolve_hub_model(REPO, HubOptions(revision=SHA, download_dir=str(cache),
                                                   offline=True))
    assert by_commit.path == found.path


def test_a_model_neither_local_nor_cached_is_one_line_at_once(cache, monkeypatch) -> None:
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    with pytest.raises(MissingModelFileError, match=r"HF_HUB_OFFLINE is set"):
        resolve_hub_model("other/model", HubOptions(download_dir=str(cache), offline=True))
    with pytest.raises(MissingModelFileError, match="revision v2 of Hub model"):
        resolve_hub_model(REPO, HubOptions(revision="v2", download_dir=str(cache),
                                           offline=True))
    with pytest.raises(MissingModelFileError, match="no such local file or folder"):
        resolve_hub_model("./no/such/folder", HubOptions(download_dir=str(cache)))


def test_an_unreachable_hub_falls_back_to_the_cache(cache) -> None:
    """Online mode against a Hub that refuses connections (a loopback port nobody listens
    on, set for the process before huggingface_hub reads it): the cached copy serves; an
    uncached one fails at once, naming the connection error."""
    import subprocess
    import sys

    script = f"""
import time
from server.config.model import HubOptions
from server.models.errors import MissingModelFileError
from server.models.hub import resolve_hub_model
print(resolve_hub_model({REPO!r}, HubOptions(download_dir={str(cache)!r})).path)
start = time.monotonic()
try:
    resolve_hub_model("other/model", HubOptions(download_dir={str(cache)!r}))
except MissingModelFileError as exc:
    print(exc)
print(f"{{time.monotonic() - start:.2f}} s")
"""
    env = {"HF_ENDPOINT": f"http://127.0.0.1:{closed_port()}", "PATH": "/usr/bin:/bin",
           "HOME": str(cache)}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=env, cwd=Path(__file__).resolve().parents[2], timeout=120)
    lines = out.stdout.splitlines()
    assert lines[0].endswith(f"snapshots/{SHA}"), out.stdout + out.stderr
    assert "Hub model other/model is not in the cache" in lines[1]
    assert "ConnectError" in lines[1], lines[1]
    print(lines[2])  # how long an unreachable Hub took to say so


@pytest.mark.slow
def test_serve_a_hub_id_from_the_cache(cache) -> None:
    """`hpu-serve serve org/name` with HF_HUB_CACHE and HF_HUB_OFFLINE, as an air-gapped
    deployment runs it; the served name is the id, as in vLLM."""
    srv = start_server(REPO, "--dtype", "float32", "--block-size", "16", "--max-num-seqs", "4",
                       env={"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"})
    try:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0)
        assert [m.id for m in client.models.list().data] == [REPO]
        reply = client.completions.create(model=REPO, prompt="the", max_tokens=2)
        assert reply.usage.completion_tokens >= 1
    finally:
        srv.stop()


def test_serve_an_unknown_hub_id_exits_with_one_line(tmp_path) -> None:
    srv = start_server("nobody/nothing", env={"HF_HUB_CACHE": str(tmp_path),
                                              "HF_HUB_OFFLINE": "1"}, wait=False)
    start = time.monotonic()
    assert srv.proc.wait(timeout=120) != 0
    log = srv.log()
    assert "error: model 'nobody/nothing' is no local path" in log, log[-2000:]
    assert "Traceback" not in log, log[-3000:]
    print(f"exited after {time.monotonic() - start:.1f} s")
