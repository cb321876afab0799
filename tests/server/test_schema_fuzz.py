"""Schemathesis against the server's own /openapi.json (as vLLM's
test_openai_schema.py does): bodies that fit the schema and bodies that do
not, a bounded number per operation. Every answer is a 2xx or a 4xx OpenAI
error object (never a 5xx), the engine stays alive, and once the case is
over the KV block pool is full again."""

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.config import (ChecksConfig, GenerationConfig, PositiveDataAcceptanceConfig, ProjectConfig,
                                 ProjectsConfig, SchemathesisConfig)

from conftest import MODEL, VOCAB_SIZE, wait_pool_full

MAX_EXAMPLES = 50  # per operation and mode
MAX_TOKENS = 4  # generation stays quick; a request asking more gets this
# A schema-valid body may still be refused with a 400 (an empty prompt, a
# context too long): only the not-a-5xx and conformance checks apply.
CONFIG = SchemathesisConfig(projects=ProjectsConfig(default=ProjectConfig(
    generation=GenerationConfig(allow_x00=False),
    checks=ChecksConfig(positive_data_acceptance=PositiveDataAcceptanceConfig(enabled=False)))))


def in_vocabulary(prompt):
    """Token ids taken into the vocabulary, so that most prompts reach the engine."""
    if isinstance(prompt, list):
        return [in_vocabulary(p) for p in prompt]
    return prompt % VOCAB_SIZE if isinstance(prompt, int) and not isinstance(prompt, bool) else prompt


def bounded(body):
    """The generated body, aimed at the engine: the served model name (a
    random one is a 404 before anything runs), prompt ids in the vocabulary,
    and at most MAX_TOKENS tokens for each of at most 2 choices, so each
    case takes little time."""
    if not isinstance(body, dict):
        return body
    if isinstance(body.get("model"), str):
        body["model"] = MODEL
    if "prompt" in body:
        body["prompt"] = in_vocabulary(body["prompt"])
    if isinstance(body.get("n"), int) and body["n"] > 2:
        body["n"] = 2
    for field in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(field), int) and body[field] > MAX_TOKENS:
            body[field] = MAX_TOKENS
    if "messages" in body and body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = MAX_TOKENS  # unset: all of max_model_len
    return body


def check(case, server):
    case.body = bounded(case.body)
    response = case.call(timeout=60)
    assert response.status_code < 500, (response.status_code, response.text, case.as_curl_command())
    if response.status_code >= 400:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}, response.text
    case.validate_response(response)
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200, case.as_curl_command()
    wait_pool_full(server.engine)


# Schemathesis' own pytest plugin (schemathesis.pytest) does not run under
# pytest 9, so each operation is fuzzed through its hypothesis strategy.
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_openapi(server, mode):
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json", config=CONFIG)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {o.label for o in operations} >= {"POST /v1/completions", "POST /v1/chat/completions", "POST /tokenize"}
    for operation in operations:
        if mode is GenerationMode.NEGATIVE and not operation.body:
            continue  # nothing to make invalid
        @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy(mode))
        def fuzz(case):
            check(case, server)

        fuzz()
