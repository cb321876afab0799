"""Tool-call and reasoning parsers (issue 16) without a server: the Hermes
and Llama 3 JSON formats, whole and as a stream grows (what is surely
content is never taken back), malformed calls left as content, the forced
call's schemas, and Qwen3's <think> split."""

import json

import jsonschema
import pytest

from pagoda.entrypoints.openai.reasoning_parsers import Qwen3ReasoningParser
from pagoda.entrypoints.openai.tool_parsers import (HermesToolParser, Llama3JsonToolParser, forced_call_schema,
                                                    forced_calls)

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def test_hermes_calls_and_content():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    content, calls = HermesToolParser().extract(text)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    # Unterminated at the end (max_tokens after the JSON): still a call.
    _, calls = HermesToolParser().extract('<tool_call>{"name": "get_time", "arguments": {}}')
    assert [c.name for c in calls] == ["get_time"]


@pytest.mark.parametrize("text", [
    "no call here",
    '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',  # broken JSON
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
    '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
])
def test_hermes_malformed_is_content(text):
    assert HermesToolParser().extract(text) == (text, [])


def test_hermes_streaming_holds_back_a_possible_call():
    parser = HermesToolParser()
    text = 'Sure <tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    sent = ""
    for end in range(1, len(text) + 1):
        visible = text[:end][: parser.content_end(text[:end])]
        assert visible.startswith(sent), "streamed content was taken back"
        sent = visible
    assert sent == "Sure "
    assert parser.content_end("Sure <tool_") == len("Sure ")
    assert parser.content_end("a < b") == len("a < b")


def test_llama3_json_calls():
    parser = Llama3JsonToolParser()
    text = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", "parameters": {}}'
    content, calls = parser.extract(text)
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    for plain in ["The weather is fine.", '{"name": "get_time", "parameters": {} trailing', '{"no": "name"}']:
        assert parser.extract(plain) == (plain, [])
    assert parser.content_end('  {"name"') == 0 and parser.content_end("<|python") == 0
    assert parser.content_end("Hello") == 5


def test_forced_schemas_accept_their_calls():
    named = forced_call_schema([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}}, True)
    jsonschema.validate({"city": "Rome"}, named)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({}, named)
    required = forced_call_schema([WEATHER, TIME], "required", True)
    output = '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Rome"}}]'
    jsonschema.validate(json.loads(output), required)
    assert [c.name for c in forced_calls(output, "required")] == ["get_time", "get_weather"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_weather", "parameters": {}}], required)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(output), forced_call_schema([WEATHER, TIME], "required", False))


def test_qwen3_reasoning_split_whole_and_streamed():
    parser = Qwen3ReasoningParser()
    text = "<think>\nThe user asks.\n</think>\n\nHello!"
    assert parser.split(text, final=True) == ("The user asks.\n", "Hello!")
    assert parser.split("Just an answer", final=True) == (None, "Just an answer")
    assert parser.split("<think>\nstill thinking", final=True) == ("still thinking", None)
    sent_r, sent_c = "", ""
    for end in range(1, len(text) + 1):
        reasoning, content = parser.split(text[:end], final=False)
        assert (reasoning or "").startswith(sent_r) and (content or "").startswith(sent_c), text[:end]
        sent_r, sent_c = reasoning or "", content or ""
    assert (sent_r, sent_c) == ("The user asks.\n", "Hello!")
