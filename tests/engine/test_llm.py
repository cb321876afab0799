"""The offline engine end to end: `LLM.generate` is greedy-equal to Hugging
Face transformers for every model family, in one batch of prompts of different
lengths, also with chunked prefill and preemption; the KV pool is whole again
after every test."""

import pytest
from checkpoints import hf_greedy

from pagoda import LLM, SamplingParams

PROMPTS = [[5, 9, 200, 17], [1], [33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49],
           [250, 3], [7] * 30, [100, 101, 102], list(range(60, 100)), [12, 13]]
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module", params=["llama", "llama_rope_llama3", "qwen2", "qwen3", "opt", "mistral"])
def family(request, make_checkpoint):
    return (request.param, *make_checkpoint(request.param))


def assert_pool_full(llm):
    kv = llm.llm_engine.kv_cache_manager
    assert kv.num_free_blocks == llm.llm_engine.runner.num_blocks, "KV blocks leaked"


def test_greedy_batch_equals_hugging_face(family):
    name, model, folder = family
    llm = LLM(folder, dtype="float32", kv_cache_space=0.05)
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs):
        assert output.prompt_token_ids == prompt
        assert output.outputs[0].token_ids == hf_greedy(model, prompt, MAX_TOKENS), f"{name}: prompt {prompt}"
        assert output.outputs[0].finish_reason == "length"
    assert_pool_full(llm)


def test_chunked_prefill_and_small_batches_change_nothing(family):
    name, model, folder = family
    llm = LLM(folder, dtype="float32", kv_cache_space=0.05, max_num_batched_tokens=7, max_num_seqs=3)
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs):
        assert output.outputs[0].token_ids == hf_greedy(model, prompt, MAX_TOKENS), f"{name}: prompt {prompt}"
    assert_pool_full(llm)


def test_preemption_keeps_outputs_identical(family):
    name, model, folder = family
    # 24 blocks of 4 tokens: far less than the batch needs at once, so
    # requests are preempted and recomputed.
    llm = LLM(folder, dtype="float32", block_size=4, num_gpu_blocks_override=24)
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    for prompt, output in zip(PROMPTS, outputs):
        assert output.outputs[0].token_ids == hf_greedy(model, prompt, MAX_TOKENS), f"{name}: prompt {prompt}"
    assert_pool_full(llm)
