"""Every error path with raw httpx (raw sockets where httpx would not send
it): OpenAI error objects with the right status, never a stack trace or a
5xx, and the server keeps serving afterwards."""

import json
import socket

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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
                 says="temperature", param="temperature")
    # Values of another JSON type are refused, not coerced.
    for field, value in (("n", "2"), ("stream", 0), ("max_tokens", 2.0), ("temperature", "0.5")):
        assert_error(post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", field: value}), 400, param=field)
    assert_error(post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "top_p": 0}), 400, says="top_p")
    assert_error(post(server, "/v1/completions", {"model": MODEL, "prompt": [5, 100000]}), 400,
                 says="outside the vocabulary")
    assert_error(post(server, "/v1/chat/completions", {"model": MODEL, "messages": []}), 400, param="messages")
    assert_error(post(server, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}),
                 400)
    still_serving(server)


@pytest.mark.parametrize("path, base", [("/v1/completions", {"prompt": "hi"}),
                                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})])
@pytest.mark.parametrize("stream", [False, True])
def test_token_ids_outside_the_vocabulary_are_a_400_before_any_stream(server, path, base, stream):
    """Checked with the other fields: a stream never starts (200) only to
    end in an error event."""
    for field, value in (("stop_token_ids", [100000]), ("logit_bias", {"100000": 1.0})):
        body = dict(base, model=MODEL, max_tokens=2, stream=stream, **{field: value})
        assert_error(post(server, path, body), 400, param=field, says="outside the vocabulary")
    still_serving(server)


def test_deeply_nested_json(server):
    from pagoda.entrypoints.openai.api_server import MAX_JSON_DEPTH

    for depth in (MAX_JSON_DEPTH, 100_000):  # the second is past the interpreter's recursion limit
        body = '{"model": "%s", "prompt": "hi", "user": %s}' % (MODEL, "[" * depth + "]" * depth)
        assert_error(post(server, "/v1/completions", content=body.encode()), 400, says="nested more than")
    # Brackets inside strings are text, not nesting.
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": [5], "user": "[{" * 100 + '\\"]', "max_tokens": 1})
    assert r.status_code == 200, r.text
    still_serving(server)


def json_values(leaf=st.one_of(st.integers(), st.text(alphabet='[]{}"\\ a'), st.none())):
    return st.recursive(leaf, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.text(alphabet='[]{}"\\ k', max_size=3), inner, max_size=3), max_leaves=40)


def depth(value) -> int:
    if isinstance(value, (list, dict)):
        return 1 + max(map(depth, value.values() if isinstance(value, dict) else value), default=0)
    return 0


@settings(max_examples=300, deadline=None)
@given(json_values(), st.integers(min_value=0, max_value=8))
def test_nested_deeper_counts_brackets_outside_strings(value, limit):
    from pagoda.entrypoints.openai.api_server import nested_deeper

    assert nested_deeper(json.dumps(value).encode(), limit) == (depth(value) > limit)


def test_content_type(server):
    body = json.dumps({"model": MODEL, "prompt": [5], "max_tokens": 2}).encode()
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        assert_error(post(server, "/v1/completions", content=body, headers={"content-type": content_type}), 415,
                     code="unsupported_media_type", says=content_type.split(";")[0])
    assert_error(post(server, "/tokenize", content=b"{}", headers={"content-type": "text/plain"}), 415)
    for content_type in ("application/json; charset=utf-8", "Application/JSON", None):  # None: no header at all
        headers = {"content-type": content_type} if content_type else {}
        r = post(server, "/v1/completions", content=body, headers=headers)
        assert r.status_code == 200, (content_type, r.text)


def raw_request(server, head: bytes, chunks=()) -> tuple[bytes, dict]:
    """Sends `head` and `chunks` on a fresh connection; returns the answer's
    status line and its JSON body (within 20 s)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=20) as sock:
        sock.sendall(head)
        for chunk in chunks:
            sock.sendall(chunk)
        answer = b""
        while b"\r\n\r\n" not in answer:
            answer += sock.recv(65536)
        status, _, rest = answer.partition(b"\r\n")
        headers, _, body = rest.partition(b"\r\n\r\n")
        length = int(dict(line.lower().split(b": ", 1) for line in headers.split(b"\r\n"))[b"content-length"])
        while len(body) < length:
            body += sock.recv(65536)
    return status, json.loads(body)


def test_chunked_body_is_bounded_while_it_streams_in(server):
    """A chunked body has no Content-Length: it is counted as it arrives and
    refused once past the bound -- here its end never comes."""
    from pagoda.entrypoints.openai.api_server import MAX_BODY_BYTES

    piece = 1 << 20
    chunk = b"%x\r\n" % piece + b" " * piece + b"\r\n"
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    status, body = raw_request(server, head, [chunk] * (MAX_BODY_BYTES // piece + 1))
    assert status.startswith(b"HTTP/1.1 413")
    assert body["error"]["message"] == f"request body over {MAX_BODY_BYTES} bytes"
    still_serving(server)


def test_huge_headers(server):
    r = httpx.get(server.url + "/v1/models", headers={"x-padding": "a" * (1 << 20)})
    assert_error(r, 400, says="headers are too large")
    status, body = raw_request(server, b"GARBAGE\x00 / HTTP/1.1\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 400") and body["error"]["type"] == "invalid_request_error"
    still_serving(server)


def test_prompts_per_request(server):
    from pagoda.entrypoints.openai.protocol import MAX_PROMPTS

    body = {"model": MODEL, "max_tokens": 1}
    assert_error(post(server, "/v1/completions", dict(body, prompt=["hi"] * (MAX_PROMPTS + 1))), 400, param="prompt",
                 says=f"at most {MAX_PROMPTS}")
    assert_error(post(server, "/v1/completions", dict(body, prompt=[[5]] * (MAX_PROMPTS + 1))), 400, param="prompt")
    r = post(server, "/v1/completions", dict(body, prompt=[[5]] * MAX_PROMPTS))
    assert r.status_code == 200 and len(r.json()["choices"]) == MAX_PROMPTS, r.text


def test_priority_needs_the_priority_policy(server):
    for path, base in (("/v1/completions", {"prompt": [5]}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        assert_error(post(server, path, dict(base, model=MODEL, max_tokens=1, priority=-1)), 400, param="priority",
                     says="--scheduling-policy priority")
        assert post(server, path, dict(base, model=MODEL, max_tokens=1, priority=0)).status_code == 200


@pytest.mark.parametrize("path, extra, says", [
    ("/v1/completions", {"best_of": 3}, "best_of"),
    ("/v1/completions", {"frobnicate": 1}, "frobnicate"),
    ("/v1/completions", {"suffix": "x"}, "suffix"),
    ("/v1/completions", {"structured_outputs": {"structural_tag": "{}"}}, "structural_tag"),
    ("/v1/chat/completions", {"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, "image_url"),
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


def test_a_request_failing_in_a_step_fails_alone(server, monkeypatch):
    """A fault inside the engine's step that one request explains (injected
    with the engine's fault hook) fails that request -- a 500 error object,
    or an error event ending its stream -- and the server serves on."""
    core = server.engine.engine
    poison = [7, 7, 7, 7]

    def fault_hook(stage, request_ids):
        if stage == "sample" and any(core.scheduler.requests[i].prompt_token_ids == poison for i in request_ids):
            raise RuntimeError("injected fault")

    monkeypatch.setattr(core, "fault_hook", fault_hook)
    body = {"model": MODEL, "prompt": poison, "max_tokens": 3}
    assert_error(post(server, "/v1/completions", body), 500, says="injected fault")
    r = post(server, "/v1/completions", dict(body, stream=True))
    events = [line.removeprefix("data: ") for line in r.text.splitlines() if line.startswith("data: ")]
    assert r.status_code == 200 and events[-1] == "[DONE]"
    assert "injected fault" in json.loads(events[-2])["error"]["message"]
    still_serving(server)
    assert httpx.get(server.url + "/health").status_code == 200


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
        # A stream's request reaches the engine before the response starts: a plain 503 too.
        assert_error(post(running, "/v1/completions", {"model": MODEL, "prompt": [5], "max_tokens": 2,
                                                       "stream": True}), 503)
    finally:
        running.stop()
