"""Tool-call parsers on canned model outputs: whole outputs, and streamed with every kind of
split (each character, random points, a BPE tokenizer's tokens). Streaming must always give
what ``extract`` gives for the whole text."""

from __future__ import annotations

import json
import keyword
import re

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from server.api.tool_parsers import (
    TOOL_PARSERS,
    ExtractedToolCalls,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    get_tool_parser,
)

HERMES, LLAMA, MISTRAL, PYTHONIC = (TOOL_PARSERS[n] for n in
                                    ("hermes", "llama3_json", "mistral", "pythonic"))
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---- helpers -------------------------------------------------------------------------------

def stream(cls: type[ToolParser], pieces: list[str]) -> tuple[str, list[list[str]]]:
    """Feed ``pieces``; (content, [[id, name, arguments], ...]) checking OpenAI's delta rules."""
    parser = cls()
    deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
    content, calls = "", []
    for d in deltas:
        assert isinstance(d, StreamDelta)
        content += d.content
        for tc in d.tool_calls:
            assert isinstance(tc, ToolCallDelta)
            if tc.index == len(calls):  # a new call: its first delta carries id and name
                assert tc.id and tc.name, tc
                calls.append([tc.id, tc.name, tc.arguments])
            else:  # later deltas only extend the latest call
                assert tc.index == len(calls) - 1 and tc.id is None and tc.name is None, tc
                calls[-1][2] += tc.arguments
    ids = [c[0] for c in calls]
    assert len(set(ids)) == len(ids)
    return content, calls


def split_at(text: str, points) -> list[str]:
    cuts = sorted({0, len(text), *points})
    return [text[a:b] for a, b in zip(cuts, cuts[1:])]


def check_consistent(cls: type[ToolParser], text: str, pieces: list[str]) -> ExtractedToolCalls:
    """Streaming ``pieces`` gives exactly what extract(text) gives; arguments are JSON objects."""
    assert "".join(pieces) == text
    want = cls().extract(text)
    content, calls = stream(cls, pieces)
    assert content == (want.content or "")
    assert [(n, a) for _, n, a in calls] == [(c.name, c.arguments) for c in want.tool_calls]
    for call in want.tool_calls:
        assert isinstance(json.loads(call.arguments), dict), call
    assert want.content is None or want.content.strip()
    return want


def calls_of(result: ExtractedToolCalls) -> list[tuple[str, object]]:
    return [(c.name, json.loads(c.arguments)) for c in result.tool_calls]


def every_split(cls: type[ToolParser], text: str) -> ExtractedToolCalls:
    """Whole, one character at a time, and cut in two at every point."""
    want = check_consistent(cls, text, [text])
    check_consistent(cls, text, list(text))
    for i in range(1, len(text)):
        check_consistent(cls, text, [text[:i], text[i:]])
    return want


# ---- canned outputs: (text, content, [(name, arguments)]) ----------------------------------

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
CASES = {
    HERMES: [
        (f"<tool_call>\n{WEATHER}\n</tool_call>", None,
         [("get_weather", {"city": "Paris", "unit": "celsius"})]),
        ("Let me check both.\n<tool_call>\n" + WEATHER + "\n</tool_call>\n<tool_call>\n"
         '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>',
         "Let me check both.\n",
         [("get_weather", {"city": "Paris", "unit": "celsius"}),
          ("get_time", {"tz": "Europe/Paris"})]),
        ("The capital of France is Paris.", "The capital of France is Paris.", []),
        ('<tool_call>\n{"name": "list_files"}\n</tool_call>', None, [("list_files", {})]),
        ('<tool_call>{"name": "noop", "arguments": {}}</tool_call>', None, [("noop", {})]),
        ('<tool_call>{"name": "write", "arguments": {"text": "a </tool_call> b <tool_call>"}}'
         "</tool_call>", None, [("write", {"text": "a </tool_call> b <tool_call>"})]),
        ('<tool_call>{"name": "traduire", "arguments": {"texte": "東京 café 🙂 \\u00e9"}}'
         "</tool_call>", None, [("traduire", {"texte": "東京 café 🙂 é"})]),
        ('<tool_call>{"name": "plan", "arguments": {"steps": [{"do": "a", "n": [1, 2.5, -3e2]},'
         ' {"do": null, "ok": true, "no": false}], "meta": {"deep": {"deeper": {}}}}}</tool_call>',
         None, [("plan", {"steps": [{"do": "a", "n": [1, 2.5, -300.0]},
                                    {"do": None, "ok": True, "no": False}],
                          "meta": {"deep": {"deeper": {}}}})]),
        ('<tool_call>{"name": "f", "parameters": {"x": 1}}</tool_call>', None, [("f", {"x": 1})]),
        ('<tool_call>{"arguments": {"x": 1}, "name": "late"}</tool_call>', None,
         [("late", {"x": 1})]),
        ('<tool_call>{"name": "enc", "arguments": "{\\"q\\": \\"x\\"}"}</tool_call>', None,
         [("enc", {"q": "x"})]),
        ('<tool_call>{"name": "e", "arguments": ""}</tool_call>', None, [("e", {})]),
        ('<tool_call>{"name": "n", "arguments": null}</tool_call>', None, [("n", {})]),
        ('<tool_call>{"name": "b", "arguments": "{oops"}</tool_call>',
         '<tool_call>{"name": "b", "arguments": "{oops"}</tool_call>', []),
        ('<tool_call>{"name": "l", "arguments": [1]}</tool_call>',
         '<tool_call>{"name": "l", "arguments": [1]}</tool_call>', []),
        ("<tool_call>\n{name: get_weather}\n</tool_call>",
         "<tool_call>\n{name: get_weather}\n</tool_call>", []),
        ('<tool_call>{"answer": 42}</tool_call>', '<tool_call>{"answer": 42}</tool_call>', []),
        ('<tool_call>{"name": 7, "arguments": {}}</tool_call>',
         '<tool_call>{"name": 7, "arguments": {}}</tool_call>', []),
        ("Use <tool_call> tags like <tool_ this", "Use <tool_call> tags like <tool_ this", []),
        ('<tool_call>{"name": "a", "arguments": {"s": "line1\nline2\ttab"}}</tool_call>', None,
         [("a", {"s": "line1\nline2\ttab"})]),
        # no closing tag (model stopped on EOS): the call still counts
        ('<tool_call>{"name": "f", "arguments": {"x": [1]}}', None, [("f", {"x": [1]})]),
        # cut short inside the arguments: they are closed so they stay valid JSON
        ('<tool_call>{"name": "f", "arguments": {"x": [1, {"y": "hal', None,
         [("f", {"x": [1, {"y": "hal"}]})]),
        ('<tool_call>{"name": "f", "arguments": {"x": 1, "y": tr', None, [("f", {"x": 1})]),
        ('<tool_call>{"name": "f", "arguments": {"x": 1, "y": 2.', None,
         [("f", {"x": 1, "y": 2})]),  # the number up to its last complete form
        ('<tool_call>{"name": "f", "arguments": {"x": "a\\u00', None, [("f", {"x": "a"})]),
        # cut short before the name is complete: the text is content
        ('Hmm <tool_call>{"name": "get_wea', 'Hmm <tool_call>{"name": "get_wea', []),
        ("\n\n<tool_call>", "\n\n<tool_call>", []),
        # broken after the call started: arguments end at the last good point, rest dropped
        ('<tool_call>{"name": "f", "arguments": {"a": 1, "b": undefined}}</tool_call>after',
         "after", [("f", {"a": 1})]),
    ],
    LLAMA: [
        ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', None,
         [("get_weather", {"city": "Paris"})]),
        ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None,
         [("get_weather", {"city": "Paris"})]),
        ('  {"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {"y": [2]}};'
         '{"name": "c", "parameters": {}}', None, [("a", {"x": 1}), ("b", {"y": [2]}), ("c", {})]),
        ('{"name": "ping"}', None, [("ping", {})]),
        ('{"name": "say", "parameters": {"text": "日本語 🙂", "nested": {"k": [true, null]}}}',
         None, [("say", {"text": "日本語 🙂", "nested": {"k": [True, None]}})]),
        ("Hello! How can I help?", "Hello! How can I help?", []),
        ("Here: {\"name\": \"x\"}", "Here: {\"name\": \"x\"}", []),
        ('{"name": "get_weather", parameters: }', '{"name": "get_weather", parameters: }', []),
        ('{"result": 42}', '{"result": 42}', []),
        ("<|python_tag|>print(1)", "<|python_tag|>print(1)", []),
        ('{"name": "a", "parameters": {}}\nDone.', "Done.", [("a", {})]),
    ],
    MISTRAL: [
        ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]', None,
         [("get_weather", {"city": "Paris"})]),
        ('Checking.[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}, {"name": "b", '
         '"arguments": {}}]', "Checking.", [("a", {"x": 1}), ("b", {})]),
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', None,
         [("get_weather", {"city": "Paris"})]),
        ('[TOOL_CALLS]a[ARGS]{"x": "東京"}[TOOL_CALLS]b_2[ARGS]{}', None,
         [("a", {"x": "東京"}), ("b_2", {})]),
        ("No tools needed.", "No tools needed.", []),
        ("[TOOL_CALLS]I cannot, sorry.", "[TOOL_CALLS]I cannot, sorry.", []),
        ('[TOOL_CALLS] [{"name": "a", arguments: 1}]', '[TOOL_CALLS] [{"name": "a", arguments: 1}]',
         []),
        ('[TOOL_CALLS]f[ARGS]{"x": [1, 2', None, [("f", {"x": [1, 2]})]),
        ('[TOOL_CALLS]f[ARGS]{"s": "a [ARGS] [TOOL_CALLS] }"}', None,
         [("f", {"s": "a [ARGS] [TOOL_CALLS] }"})]),
        ("[TOOL_CALLS][]", None, []),
        ("[TOOL_CALL] not quite", "[TOOL_CALL] not quite", []),
    ],
    PYTHONIC: [
        ('[get_weather(city="Paris", unit="celsius")]', None,
         [("get_weather", {"city": "Paris", "unit": "celsius"})]),
        ("[a(x=1), b(y='two', z=[1, 2, {'k': None}]), c()]", None,
         [("a", {"x": 1}), ("b", {"y": "two", "z": [1, 2, {"k": None}]}), ("c", {})]),
        ("\n [flags(on=True, off=False, none=None, neg=-2.5, t=(1, 2))]\n", None,
         [("flags", {"on": True, "off": False, "none": None, "neg": -2.5, "t": [1, 2]})]),
        ('[say(text="東京 🙂 ) ] (", quote=\'it\\\'s\')]', None,
         [("say", {"text": "東京 🙂 ) ] (", "quote": "it's"})]),
        ("[tools.search(q='x')]", None, [("tools.search", {"q": "x"})]),
        ("[json_style(a=true, b=null)]", None, [("json_style", {"a": True, "b": None})]),
        ("The answer is 42.", "The answer is 42.", []),
        ("[Note] see [the docs](http://x).", "[Note] see [the docs](http://x).", []),
        ("[1, 2, 3]", "[1, 2, 3]", []),
        ("[]", "[]", []),
        ("[f(1, 2)]", "[f(1, 2)]", []),
        ("[f(x=y)]", "[f(x=y)]", []),
        ("[f(x=1)] done", "done", [("f", {"x": 1})]),
        ("[f(x=1), g(", ", g(", [("f", {"x": 1})]),
        ("[f(x={1, 2})]", "[f(x={1, 2})]", []),
    ],
}
ALL_CASES = [(cls, *case) for cls, cases in CASES.items() for case in cases]
CASE_IDS = [f"{cls.name}-{i}" for cls, cases in CASES.items() for i in range(len(cases))]


@pytest.mark.parametrize(("cls", "text", "content", "calls"), ALL_CASES, ids=CASE_IDS)
def test_extract_and_stream_every_split(cls, text, content, calls) -> None:
    got = every_split(cls, text)
    assert got.content == content
    assert calls_of(got) == calls
    assert got.tools_called == bool(calls)


@pytest.mark.parametrize("cls", list(CASES))
@FAST
@given(data=st.data())
def test_random_splits_stream_like_extract(cls, data) -> None:
    text = data.draw(st.sampled_from([c[0] for c in CASES[cls]]))
    points = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    check_consistent(cls, text, split_at(text, points))


def test_bpe_token_splits() -> None:
    """Split as a byte-level BPE trained on these outputs would (multi-character tokens)."""
    tokenizers = pytest.importorskip("tokenizers")
    texts = [c[1] for c in ALL_CASES]
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts, tokenizers.trainers.BpeTrainer(vocab_size=600,
                                                                   show_progress=False))
    multi = 0
    for cls, text, *_ in ALL_CASES:
        ends = [end for _, end in tok.encode(text).offsets]
        pieces = split_at(text, ends)
        multi += sum(len(p) > 1 for p in pieces)
        check_consistent(cls, text, pieces)
    assert multi > 100


# ---- generated calls, rendered in each format ----------------------------------------------

TRICKY = ["</tool_call>", "<tool_call>", "[TOOL_CALLS]", "[ARGS]", ";", "}", "]", ")", '"',
          "\\", "'", "\n", "<|python_tag|>", "{", "é", "🙂"]
text_values = st.text(max_size=6) | st.sampled_from(TRICKY)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**20, 10**20)
    | st.floats(allow_nan=False, allow_infinity=False) | text_values,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text_values, inner, max_size=3),
    max_leaves=8)
names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,12}", fullmatch=True).filter(
    lambda n: not keyword.iskeyword(n) and n not in ("True", "False", "None"))
arguments = st.dictionaries(names, json_values, max_size=4)
calls_st = st.lists(st.tuples(names, arguments), min_size=1, max_size=3)


def render(cls, content: str, calls, style: int) -> str:
    def dump(value) -> str:
        return json.dumps(value, ensure_ascii=bool(style & 1), indent=2 if style & 2 else None)

    if cls is HERMES:
        return content + "".join(f"<tool_call>{chr(10) * (style & 1)}"
                                 f'{dump({"name": n, "arguments": a})}\n</tool_call>\n'
                                 for n, a in calls)
    if cls is LLAMA:
        return "<|python_tag|>" * (style & 1) + "; ".join(
            dump({"name": n, "parameters": a}) for n, a in calls)
    if cls is MISTRAL and style & 2:
        return content + "".join(f"[TOOL_CALLS]{n}[ARGS]{dump(a)}" for n, a in calls)
    if cls is MISTRAL:
        return content + "[TOOL_CALLS]" + dump([{"name": n, "arguments": a} for n, a in calls])
    return "[" + ", ".join(f"{n}({', '.join(f'{k}={v!r}' for k, v in a.items())})"
                           for n, a in calls) + "]"


@pytest.mark.parametrize("cls", list(CASES))
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(content=st.text(max_size=12), calls=calls_st, style=st.integers(0, 3), data=st.data())
def test_generated_calls_round_trip(cls, content, calls, style, data) -> None:
    if cls in (LLAMA, PYTHONIC) or "<tool_call>" in content or "[TOOL_CALLS]" in content:
        content = ""
    text = render(cls, content, calls, style)
    points = data.draw(st.lists(st.integers(0, len(text)), max_size=20))
    got = check_consistent(cls, text, split_at(text, points))
    assert calls_of(got) == [(n, json.loads(json.dumps(a))) for n, a in calls]
    assert got.content == (content if content.strip() else None)


FRAGMENTS = ["<tool_call>", "</tool_call>", "<tool_", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>",
             '{"name": "f", "arguments": ', '{"name": "g", "parameters": ', '"name"', '"x"',
             "{", "}", "[", "]", "(", ")", ":", ",", ";", '"', "\\", "1", "-", ".", "e", "true",
             "nul", " ", "\n", "f(x=1)", "g()", "a", "é"]
noise = st.lists(st.sampled_from(FRAGMENTS) | st.text(max_size=2), max_size=25).map("".join)


@pytest.mark.parametrize("cls", list(CASES))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=noise, data=st.data())
def test_any_text_streams_like_extract(cls, text, data) -> None:
    """Fuzz: whatever the model writes, streamed pieces agree with extract, nothing is lost
    outside calls, and arguments are always JSON objects."""
    points = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    got = check_consistent(cls, text, split_at(text, points))
    if not got.tools_called and not (cls is MISTRAL and "[TOOL_CALLS]" in text):
        assert got.content == (text if text.strip() else None)  # ([TOOL_CALLS][] is dropped)


@pytest.mark.parametrize("cls", list(CASES))
@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=30))
def test_text_without_tool_syntax_is_content(cls, text) -> None:
    assume(not any(m in text for m in ("<tool_call>", "[TOOL_CALLS]")))
    if text.lstrip()[:1] in "{[<":
        text = "x" + text
    got = check_consistent(cls, text, list(text))
    assert got.tool_calls == []
    assert got.content == (text if text.strip() else None)


# ---- streaming behaviour -------------------------------------------------------------------

def test_hermes_streams_name_early_and_arguments_incrementally() -> None:
    parser = HERMES()
    assert parser.feed("Sure.\n<tool") == StreamDelta(content="Sure.\n")  # "<tool" held back
    assert parser.feed("_call>\n") == StreamDelta()
    assert parser.feed('{"name": "get_wea') == StreamDelta()
    assert parser.feed('ther", "arguments"') == StreamDelta()
    first = parser.feed(': {"city": "Pa')
    assert first.content == ""
    [tc] = first.tool_calls
    assert (tc.index, tc.name, tc.arguments) == (0, "get_weather", '{"city": "Pa')
    assert tc.id and tc.id.startswith("call_")
    assert parser.feed('ris", "days": 1') == StreamDelta(
        tool_calls=[ToolCallDelta(0, arguments='ris", "days": 1')])
    assert parser.feed("0, ") == StreamDelta(tool_calls=[ToolCallDelta(0, arguments="0")])
    assert parser.feed('"x": tr') == StreamDelta()  # neither a key nor a literal is complete
    assert parser.feed("ue}}\n</tool_call>") == StreamDelta(
        tool_calls=[ToolCallDelta(0, arguments=', "x": true}')])
    assert parser.finish() == StreamDelta()


def test_hermes_partial_tag_that_never_completes_is_content() -> None:
    parser = HERMES()
    assert parser.feed("a <tool_c") == StreamDelta(content="a ")
    assert parser.feed("x") == StreamDelta(content="<tool_cx")
    assert parser.feed(" <") == StreamDelta(content=" ")
    assert parser.finish() == StreamDelta(content="<")


def test_finish_closes_a_call_cut_short() -> None:
    parser = HERMES()
    parser.feed('<tool_call>{"name": "f", "arguments": {"q": ["a", "b')
    assert parser.finish() == StreamDelta(tool_calls=[ToolCallDelta(0, arguments='"]}')])


def test_undecided_call_text_comes_back_as_content() -> None:
    parser = LLAMA()
    assert parser.feed(' {"nam') == StreamDelta()
    assert parser.finish() == StreamDelta(content=' {"nam')
    parser = MISTRAL()
    assert parser.feed("ok [TOOL_CALLS]get_") == StreamDelta(content="ok ")
    assert parser.feed("weather[AR") == StreamDelta()
    assert parser.finish() == StreamDelta(content="[TOOL_CALLS]get_weather[AR")


def test_llama3_decides_content_at_the_first_character() -> None:
    parser = LLAMA()
    assert parser.feed("  ") == StreamDelta()
    assert parser.feed("Hi") == StreamDelta(content="  Hi")
    assert parser.feed(" {") == StreamDelta(content=" {")


def test_mistral_named_calls_stream() -> None:
    parser = MISTRAL()
    assert parser.feed("[TOOL_CALLS]get_weather[ARGS]") == StreamDelta()
    first = parser.feed('{"city": "Par')
    [tc] = first.tool_calls
    assert (tc.index, tc.name, tc.arguments) == (0, "get_weather", '{"city": "Par')
    assert re.fullmatch(r"[A-Za-z0-9]{9}", tc.id or "")
    second = parser.feed('is"}[TOOL_CALLS]now[ARGS]{}')
    assert [(t.index, t.name, t.arguments) for t in second.tool_calls] == [
        (0, None, 'is"}'), (1, "now", "{}")]


def test_pythonic_emits_each_call_when_complete() -> None:
    parser = PYTHONIC()
    assert parser.feed('[get_weather(city="Paris"') == StreamDelta()
    out = parser.feed("), get_time(tz=")
    assert [(t.index, t.name, t.arguments) for t in out.tool_calls] == [
        (0, "get_weather", '{"city": "Paris"}')]
    out = parser.feed("'UTC')]")
    assert [(t.index, t.name, t.arguments) for t in out.tool_calls] == [
        (1, "get_time", '{"tz": "UTC"}')]
    assert parser.feed("\n") == StreamDelta()
    assert parser.finish() == StreamDelta()


def test_pythonic_gives_up_on_text_that_starts_with_a_bracket() -> None:
    parser = PYTHONIC()
    assert parser.feed("[See") == StreamDelta()
    assert parser.feed(" also]") == StreamDelta(content="[See also]")


def test_unicode_arguments_are_not_escaped() -> None:
    got = HERMES().extract('<tool_call>{"name": "t", "arguments": {"q": "Zürich 東京"}}'
                           "</tool_call>")
    assert got.tool_calls[0].arguments == '{"q": "Zürich 東京"}'
    got = PYTHONIC().extract('[t(q="Zürich 東京")]')
    assert got.tool_calls[0].arguments == '{"q": "Zürich 東京"}'


def test_arguments_text_is_kept_as_written() -> None:
    got = HERMES().extract('<tool_call>{"name": "t", "arguments": {"a":1,  "b" : [ 2 ]}}'
                           "</tool_call>")
    assert got.tool_calls[0].arguments == '{"a":1,  "b" : [ 2 ]}'


def test_raw_control_characters_in_strings_become_escapes() -> None:
    got = HERMES().extract('<tool_call>{"name": "t", "arguments": {"s": "a\nb"}}</tool_call>')
    assert got.tool_calls[0].arguments == '{"s": "a\\nb"}'
    json.loads(got.tool_calls[0].arguments)  # strict parsing accepts it


# ---- ids, registry, dataclasses ------------------------------------------------------------

def test_ids() -> None:
    text = "".join(f'<tool_call>{{"name": "f{i}"}}</tool_call>' for i in range(50))
    got = HERMES().extract(text)
    ids = [c.id for c in got.tool_calls]
    assert len(set(ids)) == 50
    assert all(re.fullmatch(r"call_[A-Za-z0-9]{24}", i) for i in ids)
    got = MISTRAL().extract('[TOOL_CALLS][{"name": "a"}, {"name": "b"}]')
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", c.id) for c in got.tool_calls)
    assert ToolCall("f", "{}").id != ToolCall("f", "{}").id


def test_registry() -> None:
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "mistral", "openai", "pythonic"}
    for name, cls in TOOL_PARSERS.items():
        assert get_tool_parser(name) is cls and cls.name == name
        assert issubclass(cls, ToolParser)
    assert HERMES.keeps_special_tokens and MISTRAL.keeps_special_tokens
    assert not LLAMA.keeps_special_tokens and not PYTHONIC.keeps_special_tokens
    with pytest.raises(ValueError, match="hermes.*llama3_json.*mistral.*openai.*pythonic"):
        get_tool_parser("nope")


def test_extracted_tool_calls() -> None:
    assert ExtractedToolCalls([ToolCall("f", "{}")], None).tools_called
    assert not ExtractedToolCalls([], "hi").tools_called


def test_extract_leaves_the_streaming_state_alone() -> None:
    parser = HERMES()
    parser.feed('<tool_call>{"name": "f", "arguments": {')
    parser.extract("plain")
    assert parser.feed('"a": 1}}</tool_call>').tool_calls == [ToolCallDelta(0, arguments='"a": 1}')]
