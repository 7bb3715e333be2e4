"""Through HTTP: the client's X-Request-Id is only a label; it never names an engine request.

Issue 33: two concurrent requests with the same X-Request-Id got a 400 and a request that
never answered (the second replaced the first's stream in the engine). Now the engine's ids
are unique per request: a duplicate id hangs nothing, crosses no wires, and tells a client
nothing about another client's requests, while the response header and the response ``id``
keep the id the client chose. An id longer than --max-request-id-length (256) is a 400.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading

import httpx
import pytest
from server_process import MODEL_NAME

pytestmark = pytest.mark.slow  # make test-fast skips it; make test (CI) runs it

PROMPTS = ([3, 4, 5, 6], [8, 9, 10, 11])  # two different answers: a crossed wire shows
TOKENS = 6
TIMEOUT = 30  # far beyond a tiny-model answer: reaching it means a hung request


def body(chat: bool, prompt: list[int], stream: bool, max_tokens: int = TOKENS) -> dict:
    fields = {"model": MODEL_NAME, "max_tokens": max_tokens, "temperature": 0,
              "ignore_eos": True, "stream": stream}
    if chat:  # the tokens as text: a different prompt per request as well
        return {**fields, "messages": [{"role": "user", "content": f"n {prompt}"}]}
    return {**fields, "prompt": prompt}


def ask(client: httpx.Client, chat: bool, prompt: list[int], stream: bool,
        request_id: str | None, max_tokens: int = TOKENS) -> tuple[int, str, str, set[str]]:
    """(status, X-Request-Id header, answer text, response ids seen: one per chunk if streamed)"""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    headers = {"X-Request-Id": request_id} if request_id else {}
    resp = client.post(path, json=body(chat, prompt, stream, max_tokens), headers=headers)
    if resp.status_code != 200:
        return resp.status_code, resp.headers.get("x-request-id", ""), resp.text, set()
    if not stream:
        data = resp.json()
        choice = data["choices"][0]
        text = choice["message"]["content"] if chat else choice["text"]
        return 200, resp.headers["x-request-id"], text, {data["id"]}
    text, ids = "", set()
    events = [line[len("data: "):] for line in resp.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", resp.text
    for event in events[:-1]:
        chunk = json.loads(event)
        assert "error" not in chunk, event
        ids.add(chunk["id"])
        for choice in chunk["choices"]:
            text += (choice["delta"].get("content") or "") if chat else choice["text"]
    return 200, resp.headers["x-request-id"], text, ids


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=TIMEOUT) as client:
        yield client


@pytest.fixture(scope="module")
def reference(http) -> dict[tuple[bool, int], str]:
    """Each prompt's greedy answer, asked alone with a fresh id."""
    return {(chat, i): ask(http, chat, prompt, False, None)[2]
            for chat in (False, True) for i, prompt in enumerate(PROMPTS)}


def test_duplicate_request_ids_never_hang_or_cross(server, reference) -> None:
    def one(chat: bool, which: int, stream: bool, request_id: str,
            start: threading.Barrier) -> tuple:
        # One client (connection pool) per request: two requests really in flight at once
        with httpx.Client(base_url=server.base_url, timeout=TIMEOUT) as client:
            start.wait(TIMEOUT)
            return ask(client, chat, PROMPTS[which], stream, request_id)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for r in range(100):
            chat = r % 2 == 1
            streams = [(False, False), (True, False), (False, True), (True, True)][r // 2 % 4]
            request_id = f"dup-{r}"
            start = threading.Barrier(2)
            futures = [pool.submit(one, chat, i, streams[i], request_id, start) for i in (0, 1)]
            for i, future in enumerate(futures):
                # A hung request fails here, after TIMEOUT, not at the end of the suite
                status, header, text, ids = future.result(timeout=2 * TIMEOUT)
                assert status == 200, (r, i, text)
                assert header == request_id
                assert ids == {("chatcmpl-" if chat else "cmpl-") + request_id}, (r, ids)
                assert text == reference[(chat, i)], (r, i, streams[i])


def test_an_id_in_flight_is_not_revealed_to_another_client(server, reference) -> None:
    """Client B reuses the id of client A's running stream: B is answered as if the id were
    free, and A's stream goes on untouched."""
    attacker = httpx.HTTPTransport(local_address="127.0.0.2")
    with httpx.Client(base_url=server.base_url, timeout=TIMEOUT) as a, \
            httpx.Client(base_url=server.base_url, timeout=TIMEOUT, transport=attacker) as b:
        payload = body(False, PROMPTS[0], True, max_tokens=48)
        with a.stream("POST", "/v1/completions", json=payload,
                      headers={"X-Request-Id": "secret-42"}) as stream:
            lines = stream.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))  # A is running
            status, header, text, ids = ask(b, False, PROMPTS[1], False, "secret-42")
            rest = [line for line in lines if line.startswith("data: ")]
        assert status == 200, text
        assert "in use" not in text
        assert header == "secret-42" and ids == {"cmpl-secret-42"}
        assert text == reference[(False, 1)]
        events = [first, *rest]
        assert events[-1] == "data: [DONE]"
        chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
        assert all("error" not in c and c["id"] == "cmpl-secret-42" for c in chunks)
        a_text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        assert a_text.startswith(reference[(False, 0)])


def test_a_request_id_over_the_limit_is_400(http) -> None:
    for path, payload in (("/v1/completions", body(False, PROMPTS[0], False)),
                          ("/v1/chat/completions", body(True, PROMPTS[0], True))):
        resp = http.post(path, json=payload, headers={"X-Request-Id": "x" * 257})
        assert resp.status_code == 400, resp.text
        assert "X-Request-Id" in resp.json()["error"]["message"]
        assert resp.headers["x-request-id"] != "x" * 257  # never echoed back
    resp = http.post("/v1/completions", json=body(False, PROMPTS[0], False),
                     headers={"X-Request-Id": "y" * 256})
    assert resp.status_code == 200
    assert resp.json()["id"] == "cmpl-" + "y" * 256
