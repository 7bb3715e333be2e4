"""The README's curl and OpenAI SDK examples, run verbatim against a live server."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def blocks(lang: str, marker: str) -> list[str]:
    found = re.findall(rf"```{lang}\n(.*?)```", README.read_text(), flags=re.S)
    return [b for b in found if marker in b]


@pytest.mark.parametrize("index", range(2))
def test_curl_examples(server, index: int) -> None:
    script = blocks("bash", "curl ")[index].replace("http://localhost:8000", server.base_url)
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    if '"stream": true' in script:
        events = [line[6:] for line in out.stdout.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["usage"]["completion_tokens"] > 0
    else:
        body = json.loads(out.stdout)
        assert body["object"] == "chat.completion"
        assert body["choices"][0]["message"]["role"]


def test_openai_sdk_example(server) -> None:
    (code,) = blocks("python", "OpenAI(")
    code = code.replace("http://localhost:8000", server.base_url)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()
