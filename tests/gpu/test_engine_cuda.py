"""The engine on a CUDA GPU end to end against Hugging Face transformers on
the same GPU (see conftest.py for how bf16 and fp32 outputs are compared):
every family, a batch of prompts of different lengths, with CUDA graphs and
eagerly, the core in this process and (the default) in its own, with chunked prefill, prefix caching and preemption; the KV pool is
whole after every run."""

import pytest

from pagoda import LLM, SamplingParams

PROMPTS = [[5, 9, 200, 17], [1], list(range(33, 50)), [250, 3], [7] * 30, [100, 101, 102], list(range(60, 100)),
           [12, 13]]
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
FAMILIES = ["llama", "qwen2", "qwen3", "opt"]


def make_llm(ref, dtype, **kwargs):
    return LLM(ref.folder, dtype=dtype, device="cuda", skip_tokenizer_init=True, multiprocess=False, **kwargs)


def assert_pool_full(llm):
    kv = llm.llm_engine.kv_cache_manager
    assert kv.num_free_blocks == llm.llm_engine.runner.num_blocks, "KV blocks leaked"


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_batch_matches_hugging_face(family, enforce_eager, dtype, reference):
    ref = reference(family)
    llm = make_llm(ref, dtype, enforce_eager=enforce_eager)
    runner = llm.llm_engine.runner
    assert (runner.graph_runner is None) == enforce_eager
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs):
        assert output.prompt_token_ids == prompt
        assert output.outputs[0].finish_reason == "length"
        ref.check_greedy(prompt, output, dtype)
    assert_pool_full(llm)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_the_default_core_process_matches_hugging_face(family, dtype, reference):
    """On a GPU the offline LLM's core runs in a process of its own by
    default (CUDA graphs, async scheduling there): the same greedy tokens."""
    ref = reference(family)
    llm = LLM(ref.folder, dtype=dtype, skip_tokenizer_init=True, gpu_memory_utilization=0.3)
    try:
        assert llm.llm_engine.core_pid is not None and llm.llm_engine.model_config.device.type == "cuda"
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        for prompt, output in zip(PROMPTS, outputs):
            ref.check_greedy(prompt, output, dtype)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_with_prompt_logprobs(family, dtype, reference):
    """7 tokens a step and 3 sequences at most: prompts prefill in chunks
    beside other requests' decodes (mixed steps run eagerly, pure decode
    steps on graphs)."""
    ref = reference(family)
    llm = make_llm(ref, dtype, max_num_batched_tokens=7, max_num_seqs=3)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs):
        ref.check_greedy(prompt, output, dtype)
        ref.check_prompt_logprobs(prompt, output, dtype)
    assert_pool_full(llm)


@pytest.mark.parametrize("family", FAMILIES)
def test_prefix_caching(family, dtype, reference):
    """A second batch sharing a 40-token prefix (2.5 blocks of 16) reads the
    cached blocks and computes only its tails."""
    ref = reference(family)
    llm = make_llm(ref, dtype)
    prefix = list(range(100, 140))
    first = [prefix + [7, 8, 9], [5, 6]]
    second = [prefix + [11], prefix[:33] + [3, 3], prefix + [7, 8, 9, 10, 12]]
    llm.generate(first, GREEDY, use_tqdm=False)
    outputs = llm.generate(second, GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in outputs] == [32, 32, 32]
    assert llm.llm_engine.kv_cache_manager.prefix_cache_stats.hits >= 96
    for prompt, output in zip(second, outputs):
        ref.check_greedy(prompt, output, dtype)
    assert_pool_full(llm)


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("family", FAMILIES)
def test_preemption(family, enforce_eager, dtype, reference):
    """8 blocks of 16 tokens for 8 requests that end up needing 14 (up to 52
    tokens each): requests are preempted and recomputed, outputs unchanged."""
    ref = reference(family)
    llm = make_llm(ref, dtype, num_gpu_blocks_override=8, enforce_eager=enforce_eager)
    assert llm.llm_engine.runner.num_blocks == 8
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    for prompt, output in zip(PROMPTS, outputs):
        ref.check_greedy(prompt, output, dtype)
    assert_pool_full(llm)
