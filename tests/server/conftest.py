"""The real server on a free loopback port (uvicorn in a background thread)
around an AsyncLLM on a tiny random Llama whose vocabulary covers a small
byte-level BPE tokenizer trained here (with a chat template), so text prompts
and chat work too."""

import time

import httpx
import pytest
from running_server import RunningServer, free_port  # noqa: F401 (the tests import them from here)

CORPUS = ["hello world, hello again. The quick brown fox jumps over the lazy dog.",
          "user assistant system: what is the capital of France? Paris is."] * 5
CHAT_TEMPLATE = ("{% for m in messages %}<sep>{{ m['role'] }}\n{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<sep>assistant\n{% endif %}")
ENGINE_ARGS = dict(dtype="float32", kv_cache_space=0.05, max_num_seqs=4)
MODEL = "tiny-llama"
MAX_MODEL_LEN = 128
VOCAB_SIZE = 320  # the model's; covers the tokenizer's 300


def make_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>", "<pad>", "<sep>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>",
                                 additional_special_tokens=["<sep>"])
    hf.chat_template = CHAT_TEMPLATE
    return hf


@pytest.fixture(scope="session")
def model_folder(tmp_path_factory):
    import torch
    import transformers
    from checkpoints import LLAMA_LIKE, save_checkpoint

    tokenizer = make_tokenizer()
    config = transformers.LlamaConfig(**dict(LLAMA_LIKE, vocab_size=VOCAB_SIZE, max_position_embeddings=MAX_MODEL_LEN))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    folder = str(tmp_path_factory.mktemp("tiny-llama"))
    save_checkpoint(model, folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def server(model_folder):
    from pagoda.engine.async_llm import AsyncLLM

    running = RunningServer(AsyncLLM(model_folder, disable_log_stats=True, **ENGINE_ARGS), MODEL)
    yield running
    running.stop()


@pytest.fixture
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def wait_pool_full(engine, timeout=10.0):
    """The engine thread frees blocks asynchronously: poll until it did."""
    kv, runner = engine.engine.kv_cache_manager, engine.engine.runner
    deadline = time.monotonic() + timeout
    while kv.num_free_blocks != runner.num_blocks:
        assert time.monotonic() < deadline, f"KV blocks leaked: {kv.num_free_blocks} of {runner.num_blocks} free"
        time.sleep(0.01)


def slow_steps(monkeypatch, engine, seconds=0.05):
    """Every model step of `engine` (an AsyncLLM) takes at least `seconds`:
    time for a client to leave, or a scrape to see, mid-request."""
    runner = engine.engine.runner
    execute = runner.execute

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return execute(*args, **kwargs)

    monkeypatch.setattr(runner, "execute", slow)


def post(server, path, body=None, content=None, headers=None):
    return httpx.post(server.url + path, json=body, content=content, headers=headers, timeout=30)


def assert_error(r, status, code=None, param=None, says=None):
    """r is an OpenAI error object with this status (and code, param, text)."""
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "Traceback" not in r.text
    if code is not None:
        assert error["code"] == code
    if param is not None:
        assert error["param"] == param
    if says is not None:
        assert says in error["message"], error["message"]
    return error
