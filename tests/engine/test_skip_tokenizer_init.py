"""skip_tokenizer_init (vLLM's): an engine without a tokenizer takes token-id
prompts and returns token ids with empty text; what needs a tokenizer (text
prompts, chat, stop strings) is a ValueError that says why."""

import pytest
from checkpoints import build_hf_model, hf_greedy, save_checkpoint

from pagoda import LLM, SamplingParams


@pytest.fixture(scope="module")
def model_and_llm(tmp_path_factory):
    model = build_hf_model("llama")
    folder = save_checkpoint(model, str(tmp_path_factory.mktemp("no-tokenizer")))  # no tokenizer files
    return model, LLM(folder, skip_tokenizer_init=True, dtype="float32", kv_cache_space=0.05)


def test_token_ids_in_token_ids_out(model_and_llm):
    model, llm = model_and_llm
    assert llm.get_tokenizer() is None
    prompts = [[3, 14, 15, 92, 65], {"prompt_token_ids": [35, 89, 79]}]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    for prompt, output in zip([[3, 14, 15, 92, 65], [35, 89, 79]], outputs):
        assert output.prompt_token_ids == prompt
        completion = output.outputs[0]
        assert completion.text == "" and completion.finish_reason == "length"
        assert completion.token_ids == hf_greedy(model, prompt, 6)


def test_stop_token_ids_still_stop(model_and_llm):
    model, llm = model_and_llm
    expected = hf_greedy(model, [7, 8, 9], 6)
    params = SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[expected[2]])
    completion = llm.generate([7, 8, 9], params, use_tqdm=False)[0].outputs[0]
    first = expected.index(expected[2])
    assert completion.token_ids == expected[: first + 1] and completion.finish_reason == "stop"


def test_what_needs_a_tokenizer_is_refused(model_and_llm):
    _, llm = model_and_llm
    with pytest.raises(ValueError, match="skip_tokenizer_init=True.*pass token ids"):
        llm.generate("hello", use_tqdm=False)
    with pytest.raises(ValueError, match="skip_tokenizer_init=True"):
        llm.generate({"prompt": "hello"}, use_tqdm=False)
    with pytest.raises(ValueError, match="chat needs a tokenizer"):
        llm.chat([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        llm.generate([1, 2, 3], SamplingParams(stop=["x"]), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()  # nothing half-added
    with pytest.raises(ValueError, match="skip_tokenizer_init must be a bool"):
        LLM(llm.llm_engine.model_config.model, skip_tokenizer_init="yes")
