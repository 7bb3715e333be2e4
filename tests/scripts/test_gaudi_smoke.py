"""scripts/gaudi_smoke.sh runs end to end with --device cpu, and fails loudly on what would
be a broken Gaudi deployment."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # make test-fast skips it; make test (CI) runs it

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gaudi_smoke.sh"


def load_smoke():  # noqa: ANN201
    spec = importlib.util.spec_from_file_location("gaudi_smoke", ROOT / "scripts" / "gaudi_smoke.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve annotations through it
    spec.loader.exec_module(module)
    return module


def test_smoke_runs_on_cpu_and_reports(tiny_model, tmp_path: Path) -> None:
    report = tmp_path / "report.md"
    out = subprocess.run(
        [str(SCRIPT), "--device", "cpu", "--model", tiny_model[0], "--concurrency", "1", "2",
         "--num-prompts", "2", "--input-len", "16", "--output-len", "4",
         "--server-arg=--max-num-seqs", "--server-arg=4", "--report-file", str(report)],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    text = report.read_text()
    assert "device: cpu" in text
    assert "### embedded SmolLM2-135M-Instruct" in text
    assert f"### {tiny_model[0]}" in text
    assert text.count("compilations while serving: 0") == 2
    assert text.count("| 1 |") == 2
    assert text.count("| 2 |") == 2
    assert "execution mode: eager" in text


def test_compilations_while_serving_fail_the_smoke_test() -> None:
    smoke = load_smoke()
    report = smoke.RunReport("m")
    smoke.read_metrics(report, "\n".join([
        '# TYPE hpu_serve:graph_compilations counter',
        'hpu_serve:graph_compilations_total{model_name="m",phase="decode",stage="serving"} 2.0',
        'hpu_serve:graph_compilations_total{model_name="m",phase="decode",stage="warmup"} 9.0',
        '# TYPE hpu_serve:warmup_seconds gauge',
        'hpu_serve:warmup_seconds{model_name="m"} 12.5',
    ]) + "\n")
    assert report.serving_compilations == 2
    assert report.warmup_seconds == 12.5
    problems = smoke.verdict([report])
    assert len(problems) == 1
    assert "2 graph compilations while serving" in problems[0]
    smoke.read_log(report, "INFO Graph/Decode captured:8 (100.0%) used_mem:1.25 GiB buckets:[]\n"
                           "INFO Execution mode: HPU graphs\n")
    assert report.graph_memory_gib == {"decode": 1.25}
    assert report.execution_mode == "HPU graphs"
