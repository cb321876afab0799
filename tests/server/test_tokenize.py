"""POST /tokenize and /detokenize with vLLM's shapes: prompts and chat
messages (the same ids /v1/chat/completions uses) to token ids and back,
and 400s for bad bodies."""

import httpx
import pytest

from conftest import MAX_MODEL_LEN, MODEL, assert_error, make_tokenizer, post


def test_tokenize_prompt_and_back(server):
    r = post(server, "/tokenize", {"model": MODEL, "prompt": "hello world, hello again"})
    assert r.status_code == 200, r.text
    out = r.json()
    tokenizer = make_tokenizer()
    assert out == {"count": len(out["tokens"]), "max_model_len": MAX_MODEL_LEN,
                   "tokens": tokenizer.encode("hello world, hello again")}
    with_strs = post(server, "/tokenize", {"prompt": "hello world, hello again", "return_token_strs": True}).json()
    assert with_strs["token_strs"] == tokenizer.convert_ids_to_tokens(out["tokens"])
    back = post(server, "/detokenize", {"model": MODEL, "tokens": out["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": "hello world, hello again"}
    assert post(server, "/detokenize", {"tokens": []}).json() == {"prompt": ""}


def test_tokenize_chat_matches_chat_completions(server):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is the capital?"}]
    out = post(server, "/tokenize", {"model": MODEL, "messages": messages}).json()
    chat = post(server, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 1}).json()
    assert out["count"] == len(out["tokens"]) == chat["usage"]["prompt_tokens"]
    text = post(server, "/detokenize", {"tokens": out["tokens"]}).json()["prompt"]
    assert text.endswith("<sep>assistant\n") and "what is the capital?" in text
    bare = post(server, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()
    assert out["tokens"][:bare["count"]] == bare["tokens"] and bare["count"] < out["count"]


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"model": MODEL}, 400, "prompt"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}, 400, "messages"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"prompt": "hi", "frobnicate": True}, 400, "frobnicate"),
    ("/tokenize", {"model": "gpt-9", "prompt": "hi"}, 404, "model"),
    ("/detokenize", {}, 400, "tokens"),
    ("/detokenize", {"tokens": ["5"]}, 400, "tokens.0"),
    ("/detokenize", {"tokens": [5, 100000]}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"model": "gpt-9", "tokens": [5]}, 404, "model"),
])
def test_bad_bodies(server, path, body, status, param):
    assert_error(post(server, path, body), status, param=param)


def test_not_json(server):
    assert_error(post(server, "/tokenize", content=b"{nope"), 400, says="not valid JSON")
    assert_error(httpx.get(server.url + "/tokenize"), 405)
