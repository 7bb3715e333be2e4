"""Prints the package structure of ``server/`` from the code's own imports.

For each package (a folder of ``server/``), the packages it imports; then the imports that
point up the layers (bench -> api -> engine -> models -> hpu), the import cycles between
modules (lazy imports inside functions included) and whether ``server/api`` imports torch.

    python scripts/import_graph.py [CHECKOUT]
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

LAYERS = ["server.bench", "server.api", "server.engine", "server.models", "server.hpu"]


def module_imports(root: Path, top_level: bool = False) -> dict[str, set[str]]:
    """Module name -> every absolute import it makes, at any depth of the code (``top_level``:
    only those run when the module is imported, outside functions and TYPE_CHECKING)."""
    out: dict[str, set[str]] = {}
    for path in sorted((root / "server").rglob("*.py")):
        name = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        names: set[str] = set()
        tree = ast.parse(path.read_text())
        nodes = _top_level(tree.body) if top_level else list(ast.walk(tree))
        for node in nodes:
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
        out[name] = names
    return out


def _top_level(body: list[ast.stmt]) -> list[ast.AST]:
    """The statements run at import: the module body, into if/try blocks, not into
    functions, classes' methods or ``if TYPE_CHECKING:``."""
    out: list[ast.AST] = []
    for node in body:
        if isinstance(node, ast.If):
            if "TYPE_CHECKING" not in ast.unparse(node.test):
                out += _top_level(node.body) + _top_level(node.orelse)
        elif isinstance(node, ast.Try):
            out += _top_level(node.body) + _top_level(node.orelse)
            for handler in node.handlers:
                out += _top_level(handler.body)
        else:
            out.append(node)
    return out


def internal_graph(imports: dict[str, set[str]]) -> dict[str, set[str]]:
    """Module -> the server modules it imports ("from a.b import c" resolved to a.b.c when
    that is a module)."""
    graph: dict[str, set[str]] = {}
    for name, names in imports.items():
        targets = set()
        for m in names:
            while m and m not in imports:
                m = m.rpartition(".")[0]
            if m and m != name:
                targets.add(m)
        graph[name] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def package_of(module: str, packages: set[str]) -> str:
    while module not in packages:
        module = module.rpartition(".")[0]
    return module


def layer_of(module: str) -> int | None:
    for i, layer in enumerate(LAYERS):
        if module == layer or module.startswith(layer + "."):
            return i
    return None


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else ".").resolve()
    imports = module_imports(root)
    graph = internal_graph(imports)
    packages = {"server"} | {".".join(p.relative_to(root).parts)
                             for p in (root / "server").rglob("*")
                             if p.is_dir() and (p / "__init__.py").exists()}
    edges: dict[str, set[str]] = defaultdict(set)
    for src, targets in graph.items():
        for dst in targets:
            a, b = package_of(src, packages), package_of(dst, packages)
            if a != b:
                edges[a].add(b)
    print(f"{len(imports)} modules in {len(packages)} packages")
    for pkg in sorted(packages):
        print(f"  {pkg:36s} -> {', '.join(sorted(edges[pkg])) or '-'}")
    upward = [(s, d) for s, ts in graph.items() for d in ts
              if layer_of(s) is not None and layer_of(d) is not None and layer_of(d) < layer_of(s)]
    print(f"upward imports: {len(upward)}")
    for s, d in sorted(upward):
        print(f"  {s} -> {d}")
    found = cycles(graph)
    print(f"import cycles: {len(found)}")
    for comp in found:
        print("  " + " <-> ".join(comp))
    api_torch = sorted(m for m, names in imports.items() if m.startswith("server.api")
                       and any(n == "torch" or n.startswith("torch.") for n in names))
    print(f"server/api modules importing torch: {len(api_torch)} {api_torch or ''}")
    # what importing the API loads at module level (top-level imports only, as Python does)
    top = internal_graph(module_imports(root, top_level=True))
    seen, todo = set(), [m for m in top if m.startswith("server.api")]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += [n for n in top[m] if n not in seen]
    via = sorted(m for m in seen if any(n == "torch" or n.startswith("torch.")
                                        for n in module_imports(root, top_level=True)[m]))
    print(f"modules importing torch that server/api loads: {len(via)} {via or ''}")


if __name__ == "__main__":
    main()
