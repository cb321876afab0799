"""Tool calling and reasoning output (issue 16) through the server and the
official openai client, on a tiny random Qwen3 with Qwen3's real tokenizer
and chat template (which renders tools and tool results). Whatever the
weights: a forced call (a named function, "required") always carries
arguments that follow the function's schema, in responses and in stream
deltas shaped as OpenAI's; "auto" needs the server's parser flags and then
reads Hermes calls from the text (the text is steered into a call here by
a regex, as random weights would never write one); a call -> tool result ->
answer round trip renders the tool's result into the prompt; --reasoning-parser
qwen3 splits <think> into reasoning_content."""

import json

import httpx
import jsonschema
import openai
import pytest
from checkpoints import qwen3_checkpoint
from conftest import RunningServer
from transformers import AutoTokenizer

MODEL = "tiny-qwen3"
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}
WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                  "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                           "parameters": WEATHER_PARAMS}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
             "required": ["zone"], "additionalProperties": False}}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
HERMES_CALL = r'<tool_call>\n\{"name": "get_time", "arguments": \{"zone": "(UTC|CET)"\}\}\n</tool_call>'


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return qwen3_checkpoint(str(tmp_path_factory.mktemp("qwen3-tools")))


def start(folder, **app_kwargs):
    from pagoda.engine.async_llm import AsyncLLM

    return RunningServer(AsyncLLM(folder, disable_log_stats=True, dtype="float32", kv_cache_space=0.1), MODEL,
                         **app_kwargs)


@pytest.fixture(scope="module")
def plain(folder):
    running = start(folder)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def parsing(folder):
    running = start(folder, tool_call_parser="hermes", enable_auto_tool_choice=True, reasoning_parser="qwen3")
    yield running
    running.stop()


def client_of(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def check_call(call):
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_named_and_required_calls_follow_the_schema(plain, seed):
    client = client_of(plain)
    named = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, seed=seed, max_tokens=120, extra_body=COMPACT,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = named.choices[0]
    assert choice.message.content is None and choice.finish_reason == "stop"
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
    check_call(choice.message.tool_calls[0])
    required = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, seed=seed, max_tokens=150,
                                              tool_choice="required", extra_body=COMPACT)
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        check_call(call)
    single = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, seed=seed, max_tokens=150,
                                            tool_choice="required", parallel_tool_calls=False, extra_body=COMPACT)
    assert len(single.choices[0].message.tool_calls) == 1


def test_a_streamed_named_call_is_shaped_as_openai(plain):
    stream = client_of(plain).chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, seed=3, max_tokens=120, stream=True, extra_body=COMPACT,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    deltas = [chunk.choices[0] for chunk in stream if chunk.choices]
    calls = [d.delta.tool_calls[0] for d in deltas if d.delta.tool_calls]
    first, rest = calls[0], calls[1:]
    assert first.index == 0 and first.id.startswith("call_") and first.type == "function"
    assert first.function.name == "get_weather"
    assert all(c.index == 0 and c.id is None and c.function.name is None for c in rest)
    arguments = "".join(c.function.arguments or "" for c in calls)
    jsonschema.validate(json.loads(arguments), WEATHER_PARAMS)
    assert len(rest) > 1, "the arguments came in one piece, not as they were generated"
    assert deltas[-1].finish_reason == "stop"
    assert not any(d.delta.content for d in deltas)


def test_auto_needs_the_servers_flags_and_bad_tools_are_400(plain):
    body = {"model": MODEL, "messages": ASK, "tools": TOOLS}
    r = httpx.post(plain.url + "/v1/chat/completions", json=body)
    assert r.status_code == 400 and "--enable-auto-tool-choice" in r.json()["error"]["message"]
    for extra, says in [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in tools"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "both constrain"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice needs tools"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}], "tool_choice": "required"}, "name"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
    ]:
        r = httpx.post(plain.url + "/v1/chat/completions", json=dict(body, **extra))
        assert r.status_code == 400, (extra, r.text)
        assert says in r.json()["error"]["message"], (extra, r.json())
    r = httpx.post(plain.url + "/v1/chat/completions", json=dict(body, tool_choice="none", max_tokens=4))
    assert r.status_code == 200 and "tool_calls" not in r.json()["choices"][0]["message"]
    r = httpx.post(plain.url + "/v1/chat/completions", json=dict(body, tool_choice="required", max_tokens=150,
                                                                 parallel_tool_calls=None, seed=0, **COMPACT))
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["tool_calls"], r.text


@pytest.mark.parametrize("stream", [False, True])
def test_auto_reads_hermes_calls_from_the_text(parsing, stream):
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=60, seed=0,
                  extra_body={"structured_outputs": {"regex": HERMES_CALL}})
    client = client_of(parsing)
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        [call] = choice.message.tool_calls
    else:
        deltas = [c.choices[0] for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
        assert not any(d.delta.content for d in deltas), "the call's text leaked as content"
        [call] = [t for d in deltas for t in d.delta.tool_calls or ()]
        assert call.index == 0 and deltas[-1].finish_reason == "tool_calls"
    assert call.function.name == "get_time"
    check_call(call)


def test_plain_text_stays_content_with_auto(parsing):
    choice = client_of(parsing).chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=30, seed=0,
        extra_body={"structured_outputs": {"regex": "It is sunny in [a-z]{3,8}\\."}}).choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason == "stop"
    assert choice.message.content.startswith("It is sunny in ")


def test_round_trip_call_tool_result_answer(plain, folder):
    client = client_of(plain)
    first = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, seed=5, max_tokens=120, extra_body=COMPACT,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}).choices[0].message
    call = first.tool_calls[0]
    messages = ASK + [first.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 C, light wind"}]
    answer = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none",
                                            max_tokens=8, seed=5)
    assert answer.choices[0].message.content is not None
    # The template saw the call and its result: both are in the prompt.
    tokens = httpx.post(plain.url + "/tokenize", json={"model": MODEL, "messages": messages}).json()["tokens"]
    prompt = AutoTokenizer.from_pretrained(folder).decode(tokens)
    assert "<tool_response>\nSunny, 24 C, light wind\n</tool_response>" in prompt
    assert call.function.arguments.replace(" ", "") in prompt.replace(" ", "")
    assert answer.usage.prompt_tokens == len(tokens)


def test_tool_messages_are_checked(plain):
    bad = [ASK + [{"role": "tool", "content": "x"}],  # no tool_call_id
           ASK + [{"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                                        "function": {"name": "get_time", "arguments": "{zone"}}]}],
           ASK + [{"role": "function", "name": "get_time", "content": "x"}]]
    for messages in bad:
        r = httpx.post(plain.url + "/v1/chat/completions", json={"model": MODEL, "messages": messages})
        assert r.status_code == 400, r.text


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_content_is_split_out(parsing, stream):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=40, seed=0,
                  extra_body={"structured_outputs": {"regex": "<think>\nhmm, [a-z]{2,6}\n</think>\n\nHello [a-z]{2,6}"}})
    client = client_of(parsing)
    if not stream:
        message = client.chat.completions.create(**kwargs).choices[0].message
        reasoning, content = message.reasoning_content, message.content
    else:
        deltas = [c.choices[0].delta for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
        reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
        content = "".join(d.content or "" for d in deltas)
    assert reasoning.startswith("hmm, ") and "<think>" not in reasoning and "</think>" not in reasoning
    assert content.startswith("Hello ") and "think" not in content
