"""gpt-oss's harmony output: the ``openai_gptoss`` reasoning parser and the ``openai`` tool
parser on canned outputs, whole and streamed with every split (each character, each cut in
two, random cuts); streamed pieces always add up to the whole reading. Both parsers chained
as the chat endpoint chains them (the reasoning parser first, the tool parser on its answer)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.api.chat_output import ChoiceReader
from server.api.reasoning_parsers import get_reasoning_parser
from server.api.tool_parsers import get_tool_parser
from server.api.tools import ToolPlan
from tests.api.test_reasoning_parsers import split_at
from tests.api.test_tool_parsers import stream as stream_tools

GPTOSS = get_reasoning_parser("openai_gptoss")
OPENAI = get_tool_parser("openai")

ANALYSIS = "<|channel|>analysis<|message|>The user asks for the weather. Call the tool.<|end|>"
CALL = ("<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city": "Paris", "unit": "celsius"}<|call|>')
FINAL = "<|start|>assistant<|channel|>final<|message|>It is 21 °C in Paris 🙂."

CASES = [
    # (output, reasoning, content, calls)
    (ANALYSIS + FINAL, "The user asks for the weather. Call the tool.",
     "It is 21 °C in Paris 🙂.", []),
    (ANALYSIS + CALL, "The user asks for the weather. Call the tool.", None,
     [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    # the stop token <|call|> is not in the text; the recipient before the channel
    (ANALYSIS + '<|start|>assistant to=functions.get_time<|channel|>commentary json'
     '<|message|>{"tz": "UTC"}', "The user asks for the weather. Call the tool.", None,
     [("get_time", {"tz": "UTC"})]),
    # a preamble on commentary, then two calls
    ("<|channel|>commentary<|message|>Checking both.<|end|>" + CALL
     + CALL.replace("Paris", "Oslo"), None, "Checking both.",
     [("get_weather", {"city": "Paris", "unit": "celsius"}),
      ("get_weather", {"city": "Oslo", "unit": "celsius"})]),
    ("<|channel|>final<|message|>Hello!", None, "Hello!", []),
    ("No markup at all.", None, "No markup at all.", []),
    # cut off by max_tokens inside the analysis, and inside a header
    ("<|channel|>analysis<|message|>still thinking", "still thinking", None, []),
    (ANALYSIS + "<|start|>assistant<|chan", "The user asks for the weather. Call the tool.",
     None, []),
    ("", None, None, []),
]


def read_whole(text: str) -> tuple:
    reasoning, answer = GPTOSS().split(text)
    found = OPENAI().extract(answer or "")
    return reasoning, found.content, [(c.name, json.loads(c.arguments))
                                      for c in found.tool_calls]


def read_streamed(pieces: list[str]) -> tuple:
    reasoning_parser = GPTOSS()
    outs = [reasoning_parser.feed(p) for p in pieces] + [reasoning_parser.finish()]
    reasoning = "".join(r for r, _ in outs)
    answers = [a for _, a in outs]
    content, calls = stream_tools(OPENAI, answers)
    return (reasoning or None, content or None,
            [(name, json.loads(args)) for _, name, args in calls])


@pytest.mark.parametrize("text, reasoning, content, calls", CASES)
def test_whole_and_every_split(text: str, reasoning, content, calls) -> None:
    want = (reasoning, content, calls)
    assert read_whole(text) == want
    assert read_streamed([text]) == want
    assert read_streamed(list(text)) == want
    for i in range(1, len(text), 3):
        assert read_streamed([text[:i], text[i:]]) == want


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_random_splits(data) -> None:
    text, *want = data.draw(st.sampled_from(CASES))
    points = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    assert read_streamed(split_at(text, points)) == tuple(want)


def test_the_tool_parser_alone_reads_raw_output() -> None:
    """Without the reasoning parser the analysis is left out (vLLM's openai parser)."""
    found = OPENAI().extract(ANALYSIS + CALL)
    assert [(c.name, json.loads(c.arguments)) for c in found.tool_calls] == \
        [("get_weather", {"city": "Paris", "unit": "celsius"})]
    assert found.content is None
    assert OPENAI().extract(ANALYSIS + FINAL).content == "It is 21 °C in Paris 🙂."


def test_call_streams_name_first_then_arguments() -> None:
    parser = OPENAI()
    assert parser.feed("<|channel|>commentary to=functions.f <|constrain|>js").tool_calls == []
    first = parser.feed('on<|message|>{"a"')
    assert [(d.name, d.arguments) for d in first.tool_calls] == [("f", '{"a"')]
    more = parser.feed(": 1}<|call|>")
    assert [(d.name, d.arguments) for d in more.tool_calls] == [(None, ": 1}")]


def test_chat_reader_chains_both_and_marks_a_call() -> None:
    plan = ToolPlan(mode="auto", parser=OPENAI, tools=[], parallel=True)
    reader = ChoiceReader(plan, GPTOSS)
    parts = reader.whole(ANALYSIS + CALL)
    assert parts.reasoning.startswith("The user asks") and parts.content == ""
    assert [c.name for c in parts.tool_calls] == ["get_weather"] and reader.called
    assert GPTOSS.keeps_special_tokens and OPENAI.keeps_special_tokens


# --- through the app and the OpenAI SDK (a scripted engine writes the harmony text) -----

HARMONY_CALL = ["<|channel|>analysis<|message|>", "Need the ", "weather.", "<|end|>",
                "<|start|>assistant<|channel|>commentary to=functions.get_weather ",
                "<|constrain|>json<|message|>", '{"city": "Pa', 'ris", "unit": "celsius"}']
HARMONY_ANSWER = ["<|channel|>analysis<|message|>", "The tool said 18 C.", "<|end|>",
                  "<|start|>assistant<|channel|>final<|message|>", "It is 18 °C ", "in Paris."]


def harmony_client(script: list[str]):
    from tests.api.test_tool_calling import scripted

    return scripted(script, reasoning_parser="openai_gptoss", enable_auto_tool_choice=True,
                    tool_call_parser="openai")


def test_sdk_reads_reasoning_content_and_calls_streamed_and_whole() -> None:
    from tests.api.test_tool_calling import TOOLS, both

    client = harmony_client(HARMONY_ANSWER)
    for reading in both(client, tools=TOOLS):
        assert reading["reasoning"] == "The tool said 18 C."
        assert reading["content"] == "It is 18 °C in Paris."
        assert reading["calls"] == [] and reading["reason"] == "stop"
    # the markers are special tokens: the detokenizer must keep them
    assert all(not params.skip_special_tokens for _, _, params in client.engine.submitted)
    client.engine.script = HARMONY_CALL
    for reading in both(client, tools=TOOLS):
        assert reading["reasoning"] == "Need the weather."
        assert reading["content"] == ""
        assert [(c["name"], json.loads(c["arguments"])) for c in reading["calls"]] == \
            [("get_weather", {"city": "Paris", "unit": "celsius"})]
        assert reading["reason"] == "tool_calls"


def test_reasoning_parser_alone_keeps_special_tokens_without_tools() -> None:
    from tests.api.test_tool_calling import scripted

    client = scripted(HARMONY_ANSWER, reasoning_parser="openai_gptoss")
    reply = client.chat.completions.create(model="fake-model",
                                           messages=[{"role": "user", "content": "Hi"}])
    assert reply.choices[0].message.content == "It is 18 °C in Paris."
    assert not client.engine.submitted[-1][2].skip_special_tokens


def test_tool_round_trip_through_the_sdk() -> None:
    """The call, the tool's answer sent back, the final answer: the history reaches the
    chat template (arguments as an object) and the answer is split again."""
    from tests.api.test_tool_calling import ASK, TOOLS

    client = harmony_client(HARMONY_CALL)
    first = client.chat.completions.create(model="fake-model", messages=ASK, tools=TOOLS)
    message = first.choices[0].message
    call = message.tool_calls[0]
    assert first.choices[0].finish_reason == "tool_calls"
    client.engine.script = HARMONY_ANSWER
    history = [*ASK, message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"}]
    final = client.chat.completions.create(model="fake-model", messages=history, tools=TOOLS)
    assert final.choices[0].message.content == "It is 18 °C in Paris."
    assert final.choices[0].message.reasoning_content == "The tool said 18 C."
    seen = client.engine.tokenizer.template_calls[-1]["messages"]
    assert seen[1]["tool_calls"][0]["function"] == {
        "name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
    assert seen[2]["content"] == "18 C, sunny"


def test_structured_outputs_start_at_the_final_channel() -> None:
    """A JSON answer is constrained from the final channel's header on (the grammar reads
    the generated text with special tokens kept, see server/engine/input_processor.py)."""
    from tests.api.test_tool_calling import scripted

    client = scripted(["{}"], reasoning_parser="openai_gptoss")
    client.chat.completions.create(model="fake-model", response_format={"type": "json_object"},
                                   messages=[{"role": "user", "content": "Hi"}])
    params = client.engine.submitted[-1][2]
    assert params.structured_outputs.start_after == "<|channel|>final<|message|>"
    assert not params.skip_special_tokens
