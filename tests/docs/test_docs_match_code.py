"""The documentation names what exists: every repository path it mentions, every package of
``server/`` in the architecture page, and every flag of ``hpu-serve serve`` in the flags table."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]
PATH = re.compile(r"\b(?:server|tests|benchmarks|config|deploy|scripts)/[\w./-]*[\w/]")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_named_path_exists(page: Path) -> None:
    text = page.read_text()
    missing = sorted({p for p in PATH.findall(text) if not (ROOT / p).exists()})
    assert not missing, f"{page.relative_to(ROOT)} names paths that do not exist: {missing}"


def test_architecture_lists_every_package() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    packages = sorted(p.parent.relative_to(ROOT).as_posix() + "/"
                      for p in (ROOT / "server").rglob("__init__.py")
                      if p.parent != ROOT / "server")
    missing = [p for p in packages if f"| `{p}` |" not in text]
    assert not missing, f"docs/architecture.md has no line for {missing}"


def section(page: str, heading: str) -> str:
    text = (ROOT / page).read_text()
    return text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def test_flags_reference_lists_every_serve_flag() -> None:
    """serving.md's flags tables are generated at build time (scripts/docs_hooks.py) from the
    parser: every flag of ``serve --help`` is in them, with its default."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import docs_hooks
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    assert docs_hooks.MARKER in section("docs/serving.md", "Flags")
    help_text = subprocess.run([sys.executable, "-m", "server", "serve", "--help"],
                               capture_output=True, text=True, check=True, cwd=ROOT).stdout
    usage = help_text.split("positional arguments:", 1)[0]
    flags = set(re.findall(r"\[(--[a-z][a-z0-9-]*)", usage))
    assert "--max-num-seqs" in flags and len(flags) > 40
    table = docs_hooks.flags_markdown()
    missing = sorted(f for f in flags if f"`{f}`" not in table)
    assert not missing, f"the generated flags reference lacks {missing}"
    assert "| `--max-num-seqs` | `256` |" in table


def test_endpoints_table_lists_every_route() -> None:
    """serving.md's endpoint table names every path the app answers (the routes a flag adds,
    sleep mode and runtime LoRA updates, are listed by hand: a default app has none)."""
    sys.path.insert(0, str(ROOT / "tests" / "api"))
    from fake_engine import FakeEngine

    from server.api.app import build_app
    from server.config import ServerConfig

    table = section("docs/serving.md", "Endpoints")
    paths = {getattr(r, "path", "") for r in build_app(FakeEngine(), ServerConfig()).routes}
    paths -= {"/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json", ""}
    named = set(re.findall(r"`(/[^`]*)`", table))
    missing = sorted(p for p in paths
                     if p not in named and p.replace("{response_id}", "{id}") not in named
                     and p.replace("{model_id:path}", "{id}") not in named)
    assert not missing, f"docs/serving.md's endpoint table lacks {missing}"
