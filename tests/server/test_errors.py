"""Every error path with raw httpx: OpenAI error objects with the right
status, never a stack trace, and the server keeps serving afterwards."""

import httpx
import pytest

from conftest import MAX_MODEL_LEN, MODEL, RunningServer, assert_error, post


def still_serving(server):
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": [5], "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_bad_json_and_bad_fields(server):
    assert_error(post(server, "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}),
                 400, says="not valid JSON")
    assert_error(post(server, "/v1/completions", content=b"[1, 2]"), 400, says="JSON object")
    assert_error(post(server, "/v1/completions", {"model": MODEL}), 400, param="prompt")
    assert_error(post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": "many"}), 400,
                 param="max_tokens")
    assert_error(post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": -1}), 400,
                 says="temperature")
    assert_error(post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "top_p": 0}), 400, says="top_p")
    assert_error(post(server, "/v1/completions", {"model": MODEL, "prompt": [5, 100000]}), 400,
                 says="outside the vocabulary")
    assert_error(post(server, "/v1/chat/completions", {"model": MODEL, "messages": []}), 400, param="messages")
    assert_error(post(server, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}),
                 400)
    still_serving(server)


@pytest.mark.parametrize("path, extra, says", [
    ("/v1/completions", {"best_of": 3}, "best_of"),
    ("/v1/completions", {"frobnicate": 1}, "frobnicate"),
    ("/v1/completions", {"suffix": "x"}, "suffix"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {}}}, "json_schema"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "json_object"),
    ("/v1/chat/completions", {"tool_choice": "auto"}, "tool_choice"),
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, "image_url"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "42", "tool_call_id": "c1"}]}, "tool"),
    ("/v1/completions", {"stream": True, "stream_options": {"continuous_usage_stats": True}},
     "continuous_usage_stats"),
])
def test_unsupported_features_are_refused(server, path, extra, says):
    base = {"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    error = assert_error(post(server, path, dict(base, model=MODEL) | extra), 400, says=says)
    assert "not supported" in error["message"]


@pytest.mark.parametrize("path, extra, says", [
    ("/v1/completions", {"n": 129}, "n must be at most 128"),
    ("/v1/completions", {"logprobs": 21}, "logprobs must be in [0, 20]"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs must be in [0, 20]"),
    ("/v1/completions", {"logit_bias": {"5": 101}}, "logit_bias values must be in [-100, 100]"),
    ("/v1/completions", {"seed": 2**80}, "seed must be None or an int in [-2**63, 2**64)"),
])
def test_limits(server, path, extra, says):
    """Values past the API's limits get a 400 naming the limit (an unbounded n
    or logprobs would let one request occupy the server)."""
    base = {"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    assert_error(post(server, path, dict(base, model=MODEL, max_tokens=2) | extra), 400, says=says)
    still_serving(server)


def test_context_length_exceeded(server):
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": [5] * 100, "max_tokens": 50})
    error = assert_error(r, 400, code="context_length_exceeded", param="max_tokens")
    assert str(MAX_MODEL_LEN) in error["message"] and "150" in error["message"]
    r = post(server, "/v1/chat/completions",
             {"model": MODEL, "messages": [{"role": "user", "content": "hello " * 200}]})
    assert_error(r, 400, code="context_length_exceeded")
    # Streaming requests are checked before the stream starts.
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": [5] * 200, "stream": True})
    assert_error(r, 400, code="context_length_exceeded")
    still_serving(server)


def test_unknown_model_and_route(server):
    assert_error(post(server, "/v1/completions", {"model": "gpt-9", "prompt": "hi"}), 404, code="model_not_found")
    assert_error(post(server, "/v1/chat/completions",
                      {"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}), 404)
    assert_error(httpx.get(server.url + "/v1/nothing"), 404)
    assert_error(httpx.get(server.url + "/v1/completions"), 405)
    still_serving(server)


def test_api_key(model_folder):
    from conftest import ENGINE_ARGS

    from pagoda.engine.async_llm import AsyncLLM

    keyed = RunningServer(AsyncLLM(model_folder, disable_log_stats=True, **ENGINE_ARGS), MODEL,
                          api_key="sesame")
    try:
        body = {"model": MODEL, "prompt": [5], "max_tokens": 2}
        assert_error(post(keyed, "/v1/completions", body), 401, code="invalid_api_key")
        assert_error(post(keyed, "/v1/completions", body, headers={"Authorization": "Bearer wrong"}), 401)
        assert_error(httpx.get(keyed.url + "/v1/models"), 401)
        assert post(keyed, "/v1/completions", body, headers={"Authorization": "Bearer sesame"}).status_code == 200
        assert httpx.get(keyed.url + "/health").status_code == 200  # health is open
    finally:
        keyed.stop()


def test_dead_engine_is_503(model_folder):
    from conftest import ENGINE_ARGS

    from pagoda.engine.async_llm import AsyncLLM

    running = RunningServer(AsyncLLM(model_folder, disable_log_stats=True, **ENGINE_ARGS), MODEL)
    try:
        running.engine.shutdown()
        assert_error(httpx.get(running.url + "/health"), 503)
        assert_error(post(running, "/v1/completions", {"model": MODEL, "prompt": [5], "max_tokens": 2}), 503)
        r = post(running, "/v1/completions", {"model": MODEL, "prompt": [5], "max_tokens": 2, "stream": True})
        assert r.status_code == 200 and '"error"' in r.text and r.text.endswith("data: [DONE]\n\n")
    finally:
        running.stop()
