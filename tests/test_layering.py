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


# The engine's leaf types: what crosses the step's arrows, importable from every role.
ENGINE_LEAVES = ["server.engine.outputs", "server.engine.sampling_params",
                 "server.engine.errors", "server.engine.inputs", "server.engine.sleep",
                 "server.engine.pooling.params", "server.engine.pooling.outputs",
                 "server.engine.lora.request", "server.engine.multimodal.inputs"]
# Inside the engine, each role may import only these engine modules (and server.config,
# server.hpu, server.models): the core knows nothing of the device, the worker nothing of the
# executors or the front end, the front end (server/engine/*.py) everything.
ENGINE_ROLES = {
    "server.engine.core": ["server.engine.core"],
    "server.engine.worker": ["server.engine.core", "server.engine.worker",
                             "server.engine.lora", "server.engine.multimodal"],
    "server.engine.executor": ["server.engine.core", "server.engine.worker",
                               "server.engine.executor"],
    "server.engine.structured_outputs": ["server.engine.structured_outputs"],
    # adapters: the runner's slots and host cache, the front end's registry
    "server.engine.lora": ["server.engine.lora"],
    # images: the processor (front end) and the encoder phase (worker), over sequences
    "server.engine.multimodal": ["server.engine.core", "server.engine.multimodal"],
}


def _within(module: str, packages: list[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


@pytest.mark.parametrize("role", sorted(ENGINE_ROLES))
def test_engine_roles_import_only_what_is_below_them(role: str) -> None:
    allowed = ENGINE_ROLES[role] + ENGINE_LEAVES
    for path in modules_under(role):
        engine = {m for m in imports_of(path) if _within(m, ["server.engine"])}
        bad = {m for m in engine if not _within(m, allowed)}
        assert not bad, f"{path.relative_to(ROOT.parent)} imports {sorted(bad)}"


def test_the_leaf_types_import_only_each_other() -> None:
    for leaf in ENGINE_LEAVES:
        path = ROOT.parent / (leaf.replace(".", "/") + ".py")
        engine = {m for m in imports_of(path) if _within(m, ["server.engine"])}
        assert not engine - set(ENGINE_LEAVES), f"{leaf} imports {sorted(engine)}"


def module_graph() -> dict[str, set[str]]:
    """Every server module and the server modules it imports (at any depth of the code: a
    lazy import inside a function closes a cycle too)."""
    modules = {".".join(p.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(
        ".__init__"): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for m in imports_of(path):
            # "from server.x import y" may name module server.x.y or a name in server.x
            while m and m not in modules:
                m = m.rpartition(".")[0]
            if m and m != name:
                targets.add(m)
        graph[name] = targets
    return graph


def test_no_import_cycles() -> None:
    graph = module_graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt):] + [nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


@pytest.mark.parametrize("package", ["engine/core", "engine/structured_outputs"])
def test_scheduling_stays_pure_python(package: str) -> None:
    banned = {"torch", "habana_frameworks", "fastapi"}
    if package == "engine/structured_outputs":  # masks are tensors; compiling is not
        paths = [ROOT / package / "limits.py", ROOT / package / "compile_worker.py"]
    else:
        paths = sorted((ROOT / package).rglob("*.py"))
    for path in paths:
        found = {m.split(".")[0] for m in imports_of(path)} & banned
        assert not found, path


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
    """Flags and variables are read in one place, the config package; the rest of the code
    receives the config it needs."""
    config = ROOT / "config"
    readers = [path for path in ROOT.rglob("*.py") if "os.environ" in path.read_text()]
    assert readers, "the config package reads the environment somewhere"
    outside = [path for path in readers if config not in path.parents]
    assert not outside, outside
