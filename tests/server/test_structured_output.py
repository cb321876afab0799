"""Structured outputs (issue 16) through the server and the official openai
client, on a tiny random Qwen3 with Qwen3's real tokenizer and chat
template: chat's response_format (json_schema, json_object, and the
client's parse() with a pydantic model), vLLM's structured_outputs and
guided_* fields on both endpoints; what xgrammar cannot compile is a 400
naming the problem, and the engine serves the next request."""

import json
import re
from typing import Literal

import jsonschema
import openai
import pytest
from checkpoints import qwen3_checkpoint
from conftest import RunningServer
from pydantic import BaseModel, Field

MODEL = "tiny-qwen3"
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}
MAX_TOKENS = 150


class Pet(BaseModel):
    kind: Literal["cat", "dog"]
    vaccinated: bool


class Person(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=120)
    tags: list[Literal["red", "green", "blue"]] = Field(max_length=3)
    pet: Pet


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from pagoda.engine.async_llm import AsyncLLM

    folder = qwen3_checkpoint(str(tmp_path_factory.mktemp("qwen3-real-tokenizer")))
    running = RunningServer(AsyncLLM(folder, disable_log_stats=True, dtype="float32", kv_cache_space=0.1), MODEL)
    yield running
    running.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def chat(client, **kwargs):
    kwargs.setdefault("max_tokens", MAX_TOKENS)
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Describe someone."}],
                                          **kwargs)


def test_parse_returns_the_pydantic_object(client):
    completion = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Describe someone."}], response_format=Person,
        max_tokens=MAX_TOKENS, seed=0, extra_body=COMPACT)
    message = completion.choices[0].message
    assert isinstance(message.parsed, Person), message.content
    assert completion.choices[0].finish_reason == "stop"


def test_json_schema_with_n_and_json_object(client):
    schema = Person.model_json_schema()
    completion = chat(client, n=2, seed=1, extra_body=COMPACT, response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}})
    for choice in completion.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), schema)
    brace = {"92": 50}  # "}" in Qwen3's vocabulary: without the grammar it would come first
    completion = chat(client, temperature=0.0, logit_bias=brace, response_format={"type": "json_object"})
    assert isinstance(json.loads(completion.choices[0].message.content), dict)
    text = chat(client, temperature=0.0, max_tokens=3, logit_bias=brace, response_format={"type": "text"})
    assert text.choices[0].message.content.startswith("}")


@pytest.mark.parametrize("extra, check", [
    ({"guided_regex": r"[a-c]{2,4}-[0-9]{1,3}"}, lambda t: re.fullmatch(r"[a-c]{2,4}-[0-9]{1,3}", t)),
    ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
    ({"guided_grammar": 'root ::= "(" [0-9] ")"'}, lambda t: re.fullmatch(r"\([0-9]\)", t)),
    ({"guided_json": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}, **COMPACT},
     lambda t: isinstance(json.loads(t)["ok"], bool)),
    ({"structured_outputs": {"choice": ["left", "right"]}}, lambda t: t in ("left", "right")),
    ({"structured_outputs": {"regex": "[0-9]{3}"}}, lambda t: re.fullmatch("[0-9]{3}", t)),
])
def test_completions_and_chat_take_vllm_fields(client, extra, check):
    completion = client.completions.create(model=MODEL, prompt="Answer:", max_tokens=MAX_TOKENS, seed=2,
                                           extra_body=extra)
    assert completion.choices[0].finish_reason == "stop" and check(completion.choices[0].text), completion
    stream = client.completions.create(model=MODEL, prompt="Answer:", max_tokens=MAX_TOKENS, seed=2,
                                       extra_body=extra, stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream) == completion.choices[0].text
    message = chat(client, seed=2, extra_body=extra).choices[0].message
    assert check(message.content), message


@pytest.mark.parametrize("body, problem", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     r"structured_outputs\.json: the JSON schema cannot be compiled: .*objekt"),
    ({"structured_outputs": {"regex": "a(b"}}, r"structured_outputs\.regex: .*parenthesis"),
    ({"guided_grammar": "root ::= "}, r"structured_outputs\.grammar: .*EBNF"),
    ({"guided_json": {"type": "object"}, "structured_outputs": {"json": {"type": "object"}}},
     "guided_json and structured_outputs.json are both set"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "exactly one of .* got regex, choice"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "response_format and structured_outputs"),
    ({"response_format": {"type": "json_schema"}}, "needs json_schema"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structural_tag.* is not supported"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "needs the server started with --enable-auto"),
])
def test_what_cannot_be_followed_is_a_400_and_the_engine_serves_on(client, body, problem):
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, extra_body=body)
    assert caught.value.status_code == 400
    assert re.search(problem, caught.value.body["message"]), caught.value.body
    completion = chat(client, seed=3, extra_body={"guided_choice": ["fine"]})
    assert completion.choices[0].message.content == "fine"
