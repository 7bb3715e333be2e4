"""Reasoning parsers: reasoning vs answer on canned outputs, whole and streamed with markers
split anywhere; streamed pieces always add up to ``split`` of the whole text."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.api.reasoning_parsers import (
    REASONING_PARSERS,
    ReasoningParser,
    get_reasoning_parser,
)

R1, QWEN3 = REASONING_PARSERS["deepseek_r1"], REASONING_PARSERS["qwen3"]


def stream(cls: type[ReasoningParser], pieces: list[str]) -> tuple[str, str]:
    parser = cls()
    outs = [parser.feed(p) for p in pieces] + [parser.finish()]
    for out in outs:
        assert isinstance(out, tuple) and len(out) == 2
    return "".join(r for r, _ in outs), "".join(c for _, c in outs)


def split_at(text: str, points) -> list[str]:
    cuts = sorted({0, len(text), *points})
    return [text[a:b] for a, b in zip(cuts, cuts[1:])]


def check(cls: type[ReasoningParser], text: str, pieces: list[str]) -> tuple:
    want = cls().split(text)
    assert want[0] != "" and want[1] != ""  # empty parts are None
    assert stream(cls, pieces) == (want[0] or "", want[1] or "")
    return want


def every_split(cls: type[ReasoningParser], text: str) -> tuple:
    want = check(cls, text, [text])
    check(cls, text, list(text))
    for i in range(1, len(text)):
        check(cls, text, [text[:i], text[i:]])
    return want


CASES = [
    (R1, "Let me think.\nIt is 4.\n</think>\n\nThe answer is 4.",
     ("Let me think.\nIt is 4.\n", "The answer is 4.")),
    (R1, "<think>\nhmm\n</think>\n\nok", ("\nhmm\n", "ok")),
    (R1, "  <think>hmm</think>ok", ("hmm", "ok")),
    (R1, "still thinking, cut off by max_tokens", ("still thinking, cut off by max_tokens", None)),
    (R1, "</think>\n\nDirect answer.", (None, "Direct answer.")),
    (R1, "\n\n</think>\n\nDirect answer.", (None, "Direct answer.")),
    (R1, "reasoning</think>", ("reasoning", None)),
    (R1, "a </thinking> b </th", ("a </thinking> b </th", None)),
    (R1, "x<think>y</think>z</think>w", ("x<think>y", "z</think>w")),
    (R1, "<thi", ("<thi", None)),
    (R1, "", (None, None)),
    (R1, "思考 🙂</think>答え", ("思考 🙂", "答え")),
    (QWEN3, "<think>\nThe user wants 2+2.\n</think>\n\n4", ("\nThe user wants 2+2.\n", "4")),
    (QWEN3, "\n<think>r</think>c", ("r", "c")),
    (QWEN3, "<think>\n\n</think>\n\nHello!", (None, "Hello!")),
    (QWEN3, "Hello! No thinking here.", (None, "Hello! No thinking here.")),
    (QWEN3, "Use <think> tags.", (None, "Use <think> tags.")),
    (QWEN3, "<think>unclosed reasoning", ("unclosed reasoning", None)),
    (QWEN3, "<thin", (None, "<thin")),
    (QWEN3, "  \n", (None, None)),
    (QWEN3, "<think>a</think>b</think>c", ("a", "b</think>c")),
]


@pytest.mark.parametrize(("cls", "text", "want"), CASES,
                         ids=[f"{c.name}-{i}" for i, (c, *_) in enumerate(CASES)])
def test_split_and_stream_every_split(cls, text, want) -> None:
    assert every_split(cls, text) == want == reference(cls, text)


pieces_st = st.lists(st.sampled_from(["<think>", "</think>", "<th", "ink>", "</", "<", ">", "\n",
                                      " ", "a", "é", "🙂", "think"]) | st.text(max_size=3),
                     max_size=20).map("".join)


def reference(cls: type[ReasoningParser], text: str) -> tuple[str | None, str | None]:
    """The rules, written plainly for whole texts."""
    body = text.lstrip()
    if body.startswith("<think>"):
        text = body[len("<think>"):]
    elif cls is QWEN3:  # no <think>: all answer
        return None, body or None
    reasoning, _, answer = text.partition("</think>")
    return reasoning if reasoning.strip() else None, answer.lstrip() or None


@pytest.mark.parametrize("cls", [R1, QWEN3])
@settings(max_examples=300, deadline=None)
@given(text=pieces_st, data=st.data())
def test_random_splits_stream_like_split(cls, text, data) -> None:
    points = data.draw(st.lists(st.integers(0, len(text)), max_size=10))
    assert check(cls, text, split_at(text, points)) == reference(cls, text)


@given(reasoning=st.text().filter(lambda t: "</think>" not in t and t.strip()),
       answer=st.text().filter(lambda t: t.strip()), data=st.data())
@settings(max_examples=100, deadline=None)
def test_generated_deepseek_outputs(reasoning, answer, data) -> None:
    if reasoning.lstrip().startswith("<think>") or "<think>".startswith(reasoning.lstrip()):
        reasoning = "x" + reasoning
    text = reasoning + "</think>\n\n" + answer
    points = data.draw(st.lists(st.integers(0, len(text)), max_size=10))
    assert check(R1, text, split_at(text, points)) == (reasoning, answer.lstrip())


def test_markers_split_across_deltas_are_held_back() -> None:
    parser = R1()
    assert parser.in_reasoning
    assert parser.feed("step one </th") == ("step one ", "")
    assert parser.in_reasoning
    assert parser.feed("ink>\n") == ("", "")
    assert not parser.in_reasoning
    assert parser.feed("\nAnswer") == ("", "Answer")
    assert parser.finish() == ("", "")


def test_held_text_that_is_no_marker_comes_back() -> None:
    parser = R1()
    assert parser.feed("a </thi") == ("a ", "")
    assert parser.feed("s is") == ("</this is", "")
    assert parser.feed(" <") == (" ", "")
    assert parser.finish() == ("<", "")


def test_qwen3_waits_for_the_opening_marker() -> None:
    parser = QWEN3()
    assert not parser.in_reasoning
    assert parser.feed("\n<thi") == ("", "")
    assert parser.feed("nk>\nhm") == ("\nhm", "")
    assert parser.in_reasoning
    assert parser.feed("m</think>\n\nHi") == ("m", "Hi")
    assert not parser.in_reasoning
    parser = QWEN3()
    assert parser.feed("<") == ("", "")
    assert parser.feed("b>bold</b>") == ("", "<b>bold</b>")
    assert not parser.in_reasoning


def test_whitespace_only_reasoning_is_none_when_streamed_too() -> None:
    parser = QWEN3()
    assert parser.feed("<think>\n") == ("", "")
    assert parser.feed("\n</think>\n\n") == ("", "")
    assert parser.feed("Hi") == ("", "Hi")
    parser = R1()
    assert parser.feed("\n") == ("", "")
    assert parser.feed("\nWell") == ("\n\nWell", "")  # kept once real reasoning follows


def test_split_leaves_the_streaming_state_alone() -> None:
    parser = R1()
    parser.feed("thinking")
    assert parser.split("a</think>b") == ("a", "b")
    assert parser.in_reasoning
    assert parser.feed("</think>done") == ("", "done")


def test_registry() -> None:
    assert set(REASONING_PARSERS) == {"deepseek_r1", "qwen3", "openai_gptoss"}
    for name, cls in REASONING_PARSERS.items():
        assert get_reasoning_parser(name) is cls and cls.name == name
        # gpt-oss's harmony channels instead of tags (tests/api/test_harmony.py)
        assert (cls.start, cls.end) == (("<|channel|>analysis<|message|>",
                                         "<|channel|>final<|message|>")
                                        if name == "openai_gptoss" else ("<think>", "</think>"))
    with pytest.raises(ValueError, match="deepseek_r1.*qwen3"):
        get_reasoning_parser("nope")
