"""The documentation site builds with ``mkdocs build --strict`` (a broken link or anchor, or a
page left out of the nav, fails it), and the README stays a short page whose links resolve."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import yaml
from markdown.extensions.toc import slugify

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README_MAX_LINES = 170


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
         str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},  # no end-of-life banner
    )
    assert out.returncode == 0, out.stdout + out.stderr
    serving = (tmp_path / "site" / "serving" / "index.html").read_text()
    # the hook expanded the flags reference (generated from the config's fields)
    assert "--allowed-headers" in serving and "<!-- flags: serve -->" not in serving


def nav_pages(nav: list) -> set[str]:
    pages: set[str] = set()
    for entry in nav:
        for value in (entry.values() if isinstance(entry, dict) else [entry]):
            pages |= nav_pages(value) if isinstance(value, list) else {value}
    return pages


def test_every_page_is_in_the_nav() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    assert nav_pages(config["nav"]) == pages


def test_readme_is_short() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines"


def anchors_of(page: Path) -> set[str]:
    """Heading ids as MkDocs (and GitHub) make them: code marks dropped, then slugified."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {slugify(m.replace("`", ""), "-")
            for m in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}


def test_readme_links_resolve() -> None:
    """MkDocs checks the pages' links; the README is not one of its pages, so its relative
    links (to docs/*.md, read on GitHub) are checked here, anchors included."""
    links = re.findall(r"\]\(([^)\s]+)\)", (ROOT / "README.md").read_text())
    local = [link for link in links if not re.match(r"[a-z]+://", link)]
    assert any(link.startswith("docs/") for link in local)
    for link in local:
        path, _, anchor = link.partition("#")
        target = ROOT / path
        assert target.is_file(), link
        if anchor:
            assert anchor in anchors_of(target), link
