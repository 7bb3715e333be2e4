"""Dependencies point one way: bench -> api -> engine -> models -> hpu; nothing imports upwards."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "server"
LAYERS = ["server.bench", "server.api", "server.engine", "server.models", "server.hpu"]


def imports_of(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def modules_under(package: str) -> list[Path]:
    return sorted((ROOT.parent / package.replace(".", "/")).rglob("*.py"))


@pytest.mark.parametrize("layer", LAYERS)
def test_no_upward_imports(layer: str) -> None:
    above = LAYERS[: LAYERS.index(layer)]
    for path in modules_under(layer):
        bad = {m for m in imports_of(path) if any(m == a or m.startswith(a + ".") for a in above)}
        assert not bad, f"{path.relative_to(ROOT.parent)} imports upwards: {sorted(bad)}"


@pytest.mark.parametrize("module", ["engine/scheduler.py", "engine/block_manager.py",
                                    "engine/sequence.py"])
def test_scheduling_stays_pure_python(module: str) -> None:
    banned = {"torch", "habana_frameworks", "fastapi"}
    found = {m.split(".")[0] for m in imports_of(ROOT / module)} & banned
    assert not found


def test_device_and_engine_layers_never_speak_http() -> None:
    for layer in LAYERS[LAYERS.index("server.engine"):]:
        for path in modules_under(layer):
            found = {m.split(".")[0] for m in imports_of(path)} & {"fastapi", "starlette", "uvicorn"}
            assert not found, path


def test_the_api_package_imports_no_torch() -> None:
    """The API knows the engine only through leaf types (outputs, sampling params): the
    whole app imports without torch, in a fresh interpreter."""
    import subprocess
    import sys

    probe = "import sys, server.api.app, server.api.http_server; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True, cwd=ROOT.parent).stdout.strip()
    assert out == "False"


def test_only_config_reads_the_environment() -> None:
    for path in ROOT.rglob("*.py"):
        if path.name == "config.py" and path.parent == ROOT:
            continue
        assert "os.environ" not in path.read_text(), path
