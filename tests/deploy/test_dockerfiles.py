"""Both images pass hadolint and keep the promises docs/deployment.md makes about them. No Docker
engine runs here, so the images themselves are not built by the tests."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = [ROOT / "deploy" / "docker" / f"Dockerfile.{kind}" for kind in ("cpu", "hpu")]
HADOLINT = Path(sys.executable).with_name("hadolint")


def hadolint(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(HADOLINT), "--no-color", str(path)], capture_output=True,
                          text=True, check=False)


def test_hadolint_catches_a_bad_dockerfile(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nRUN pip install flask\n")
    out = hadolint(bad)
    assert out.returncode != 0
    assert "DL3006" in out.stdout
    assert "DL3013" in out.stdout


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_clean(dockerfile: Path) -> None:
    out = hadolint(dockerfile)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip() == ""


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_image_contract(dockerfile: Path) -> None:
    text = dockerfile.read_text()
    final_stage = text[text.rindex("\nFROM "):]
    assert re.search(r"^USER \$\{UID\}$", final_stage, re.MULTILINE)  # non-root (UID 1000)
    assert "EXPOSE 8000" in final_stage
    assert 'VOLUME ["/models", "/cache"]' in final_stage
    assert re.search(r"HEALTHCHECK .*start-period=\d+s", final_stage)
    assert "http://127.0.0.1:8000/health" in final_stage
    assert 'ENTRYPOINT ["hpu-serve", "serve", "--host", "0.0.0.0", "--port", "8000"]' in text
    assert "TORCHINDUCTOR_CACHE_DIR=/cache/" in final_stage  # compile cache on the volume


def test_hpu_image_keeps_the_vendor_torch() -> None:
    text = (ROOT / "deploy" / "docker" / "Dockerfile.hpu").read_text()
    assert "vault.habana.ai/gaudi-docker/" in text
    assert "pytorch-installer" in text
    # the project is installed under a constraint pinning the image's torch build
    assert re.search(r'--constraint /tmp/vendor.txt "?\./', text)
    assert "torch" in text
    assert not re.search(r"pip install[^\n]*\btorch==", text)
    assert "PT_HPU_RECIPE_CACHE_CONFIG=/cache/" in text


def test_cpu_image_pins_a_cpu_torch() -> None:
    text = (ROOT / "deploy" / "docker" / "Dockerfile.cpu").read_text()
    assert "download.pytorch.org/whl/cpu" in text
    assert "torch==${TORCH_VERSION}" in text
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    pinned = re.search(r"torch==([\d.]+)", setup).group(1)
    assert f"ARG TORCH_VERSION={pinned}" in text  # the version the test suite runs on


def test_build_context_carries_what_the_images_copy() -> None:
    ignore = (ROOT / ".dockerignore").read_text().split()
    for kept in ("!pyproject.toml", "!README.md", "!server/", "!config/chat_templates/"):
        assert kept in ignore


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_ray_is_a_build_option(dockerfile: Path) -> None:
    """The chart's multiHost pods run `ray start`: Ray is installed with --build-arg RAY_VERSION."""
    text = dockerfile.read_text()
    assert 'ARG RAY_VERSION=""' in text
    assert re.search(r'if \[ -n "\$\{RAY_VERSION\}" \]; then\s*\\?\s*pip install [^\n]*'
                     r'"ray==\$\{RAY_VERSION\}"; fi', text)
