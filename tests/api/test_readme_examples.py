"""The curl, OpenAI SDK and Anthropic SDK examples of the README and of docs/serving.md, run
verbatim against a live server: an example that stops working, or goes missing from its page,
fails here."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# page -> how many curl and SDK examples it must hold (a vanished example fails too)
PAGES = {"README.md": {"curl": 1, "sdk": 2, "anthropic": 1},
         "docs/serving.md": {"curl": 4, "sdk": 2, "anthropic": 1}}
EXAMPLE_URL = "http://localhost:8000"

# the pages' examples through a live server: CI's check, not the edit loop's
pytestmark = pytest.mark.slow


def blocks(page: str, lang: str, marker: str) -> list[str]:
    found = re.findall(rf"```{lang}\n(.*?)```", (ROOT / page).read_text(), flags=re.S)
    return [b for b in found if marker in b and EXAMPLE_URL in b]


def curl_examples(page: str) -> list[str]:
    return blocks(page, "bash", "curl ")


def sdk_examples(page: str) -> list[str]:
    return blocks(page, "python", "OpenAI(")


def anthropic_examples(page: str) -> list[str]:
    return blocks(page, "python", "anthropic.Anthropic(")


@pytest.mark.parametrize("page", sorted(PAGES))
def test_each_page_holds_its_examples(page: str) -> None:
    assert len(curl_examples(page)) == PAGES[page]["curl"], page
    assert len(sdk_examples(page)) == PAGES[page]["sdk"], page
    assert len(anthropic_examples(page)) == PAGES[page]["anthropic"], page


CURL_CASES = [(page, i) for page, n in sorted(PAGES.items()) for i in range(n["curl"])]
SDK_CASES = [(page, i) for page, n in sorted(PAGES.items()) for i in range(n["sdk"])]
ANTHROPIC_CASES = [(page, i) for page, n in sorted(PAGES.items())
                   for i in range(n["anthropic"])]


@pytest.mark.parametrize(("page", "index"), CURL_CASES)
def test_curl_examples(server, page: str, index: int) -> None:
    script = curl_examples(page)[index].replace(EXAMPLE_URL, server.base_url)
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    if '"stream": true' in script:
        events = [line[6:] for line in out.stdout.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["usage"]["completion_tokens"] > 0
    elif "/v1/messages" in script:
        body = json.loads(out.stdout)
        assert body["type"] == "message" and body["content"], body
    else:
        body = json.loads(out.stdout)
        if body.get("object") == "response":  # /v1/responses
            assert body["status"] in ("completed", "incomplete") and body["output"], body
            return
        assert body["object"] == "chat.completion", body
        assert body["choices"][0]["message"]["role"]


@pytest.mark.parametrize(("page", "index"), SDK_CASES)
def test_openai_sdk_examples(server, page: str, index: int) -> None:
    code = sdk_examples(page)[index].replace(EXAMPLE_URL, server.base_url)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()


@pytest.mark.parametrize(("page", "index"), ANTHROPIC_CASES)
def test_anthropic_sdk_examples(server, page: str, index: int) -> None:
    code = anthropic_examples(page)[index].replace(EXAMPLE_URL, server.base_url)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "input_tokens" in out.stdout  # it got to the streamed answer's usage
