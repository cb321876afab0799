"""The OpenAI endpoints through the official `openai` client: completions
(text, token ids, several prompts, n>1, logprobs, echo), chat, streaming of
both with usage, concurrent streams, and aborts on client disconnect."""

import concurrent.futures
import json
import time

import httpx

from conftest import MAX_MODEL_LEN, MODEL, slow_steps, wait_pool_full

GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True})


def test_models_health_version(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].max_model_len == MAX_MODEL_LEN
    # Named as served: no file system path of the server's.
    assert httpx.get(server.url + "/v1/models").json()["data"][0]["root"] == MODEL
    assert httpx.get(server.url + "/health").status_code == 200
    assert "version" in httpx.get(server.url + "/version").json()


def test_completion_text_and_token_ids(client):
    out = client.completions.create(model=MODEL, prompt="hello world", max_tokens=5, **GREEDY)
    assert out.object == "text_completion" and out.id.startswith("cmpl-") and out.model == MODEL
    [choice] = out.choices
    assert choice.index == 0 and choice.finish_reason == "length" and isinstance(choice.text, str)
    assert out.usage.completion_tokens == 5
    assert out.usage.total_tokens == out.usage.prompt_tokens + 5
    # The same prompt as token ids gives the same greedy text.
    from conftest import make_tokenizer
    ids = make_tokenizer().encode("hello world")
    again = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, **GREEDY)
    assert again.choices[0].text == choice.text
    assert again.usage.prompt_tokens == len(ids) == out.usage.prompt_tokens


def test_completion_several_prompts_and_n(client):
    out = client.completions.create(model=MODEL, prompt=[[5, 6, 7], [40, 41]], n=2, max_tokens=4, seed=1,
                                    temperature=1.0, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    assert all(c.finish_reason == "length" for c in out.choices)
    assert out.usage.prompt_tokens == 5 and out.usage.completion_tokens == 16


def test_completion_logprobs_and_echo(client):
    out = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=3, logprobs=2, **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert all(x <= 0 for x in lp.token_logprobs)
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)  # top 2, plus the chosen token
    echoed = client.completions.create(model=MODEL, prompt="hello", max_tokens=3, echo=True, **GREEDY)
    plain = client.completions.create(model=MODEL, prompt="hello", max_tokens=3, **GREEDY)
    assert echoed.choices[0].text == "hello" + plain.choices[0].text


def test_completion_stream_equals_non_stream(client):
    whole = client.completions.create(model=MODEL, prompt=[9, 10, 11], max_tokens=8, **GREEDY)
    chunks = list(client.completions.create(model=MODEL, prompt=[9, 10, 11], max_tokens=8, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert chunks[-1].usage.completion_tokens == 8 and not chunks[-1].choices


def test_chat(client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, n=2, **GREEDY)
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    assert [c.index for c in out.choices] == [0, 1]
    assert all(c.message.role == "assistant" and c.finish_reason == "length" for c in out.choices)
    assert out.choices[0].message.content == out.choices[1].message.content  # greedy
    assert out.usage.completion_tokens == 12
    with_lp = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=3,
                                             logprobs=True, top_logprobs=2, **GREEDY)
    content = with_lp.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)
    assert "".join(t.token for t in content) == with_lp.choices[0].message.content


def test_chat_stream(client):
    messages = [{"role": "user", "content": "what is the capital of France?"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=7, **GREEDY)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=7, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    deltas = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in deltas) == whole.choices[0].message.content
    assert deltas[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 7


def test_raw_stream_framing(server):
    body = {"model": MODEL, "prompt": [5, 6], "max_tokens": 3, "stream": True, "temperature": 0}
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events[:-1])
    assert all(json.loads(e[6:])["object"] == "text_completion" for e in events[:-2])


def test_concurrent_streams(server, client):
    def one(i):
        chunks = client.completions.create(model=MODEL, prompt=[5 + i, 6, 7], max_tokens=10, stream=True, **GREEDY)
        return "".join(c.choices[0].text for c in chunks if c.choices)

    def reference(i):
        return client.completions.create(model=MODEL, prompt=[5 + i, 6, 7], max_tokens=10, **GREEDY).choices[0].text

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        streamed = list(pool.map(one, range(6)))
    assert streamed == [reference(i) for i in range(6)]
    wait_pool_full(server.engine)


def test_disconnect_mid_stream_aborts(server, monkeypatch):
    slow_steps(monkeypatch, server.engine)  # unaborted, the 100 tokens would take 5 s
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 100, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        # Leaving the block closes the connection after the first chunk.
    closed = time.monotonic()
    wait_pool_full(server.engine, timeout=10)
    assert time.monotonic() - closed < 2.5, "the request ran on after the client left"
    assert not server.engine.engine.has_unfinished_requests()


def test_disconnect_mid_request_aborts(server, monkeypatch):
    """A non-streaming request whose client leaves is aborted too."""
    slow_steps(monkeypatch, server.engine)  # unaborted, the 100 tokens would take 5 s
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 100, "ignore_eos": True}
    try:
        httpx.post(server.url + "/v1/completions", json=body, timeout=0.5)
        raise AssertionError("the request finished before the client left")
    except httpx.ReadTimeout:
        pass  # the client gives up and closes its connection
    closed = time.monotonic()
    wait_pool_full(server.engine, timeout=10)
    assert time.monotonic() - closed < 2.5, "the request ran on after the client left"
    assert not server.engine.engine.has_unfinished_requests()
    still = httpx.post(server.url + "/v1/completions", json=dict(body, max_tokens=2), timeout=30)
    assert still.status_code == 200


def check_timings(timings):
    assert set(timings) == {"queue_s", "prefill_s", "decode_s", "total_s"}
    assert all(0 <= v < 60 for v in timings.values())
    assert timings["queue_s"] + timings["prefill_s"] + timings["decode_s"] <= timings["total_s"] + 1e-6
    assert timings["decode_s"] > 0  # several tokens were decoded


def test_timings_on_request(server):
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True}
    plain = httpx.post(server.url + "/v1/completions", json=body, timeout=30).json()
    assert "timings" not in plain
    timed = httpx.post(server.url + "/v1/completions", json=dict(body, return_timings=True), timeout=30).json()
    check_timings(timed["timings"])
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "ignore_eos": True,
            "return_timings": True}
    check_timings(httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=30).json()["timings"])


def stream_events(server, path, body):
    with httpx.stream("POST", server.url + path, json=dict(body, stream=True), timeout=30) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_timings_in_last_stream_chunk(server):
    body = {"model": MODEL, "prompt": [[5, 6, 7], [8, 9]], "max_tokens": 4, "ignore_eos": True}
    assert all("timings" not in c for c in stream_events(server, "/v1/completions", body))
    chunks = stream_events(server, "/v1/completions", dict(body, return_timings=True))
    assert all("timings" not in c for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and "usage" not in chunks[-1]
    check_timings(chunks[-1]["timings"])
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "ignore_eos": True,
            "return_timings": True, "stream_options": {"include_usage": True}}
    last = stream_events(server, "/v1/chat/completions", chat)[-1]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 4
    check_timings(last["timings"])
