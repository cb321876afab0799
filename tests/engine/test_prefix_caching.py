"""Automatic prefix caching and scheduling policies through the whole engine
(tiny random checkpoints, greedy, against Hugging Face): a request sharing a
long prefix computes only its tail, outputs are identical with caching on and
off (also under preemption), prompt_logprobs are whole, the priority policy
serves an important late request first, and the KV pool is whole after every
test."""

import pytest
from checkpoints import hf_greedy

from pagoda import LLM, SamplingParams

PREFIX = list(range(100, 140))  # 40 tokens: 10 blocks of 4
SHARED = [PREFIX + [7, 8, 9], PREFIX + [11], PREFIX[:21] + [3, 3], PREFIX + [7, 8, 9, 10, 12], [5, 6], PREFIX[:8]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module", params=["llama", "opt"])
def family(request, make_checkpoint):
    return (request.param, *make_checkpoint(request.param))


def count_computed_tokens(llm):
    """Wraps the runner to count the tokens whose KV each step computes."""
    runner = llm.llm_engine.runner
    counts = {}
    execute = runner.execute

    def counting(scheduled, *args, **kwargs):
        for item in scheduled.scheduled:
            counts[item.request_id] = counts.get(item.request_id, 0) + len(item.token_ids)
        return execute(scheduled, *args, **kwargs)

    runner.execute = counting
    return counts


def assert_pool_full(llm):
    assert llm.llm_engine.kv_cache_manager.num_free_blocks == llm.llm_engine.runner.num_blocks, "KV blocks leaked"


def test_shared_prefix_computes_only_the_tail(family):
    name, model, folder = family
    llm = LLM(folder, dtype="float32", block_size=4, kv_cache_space=0.05)
    counts = count_computed_tokens(llm)
    first, second = PREFIX + [7, 8, 9], PREFIX + [21, 22]
    out_first = llm.generate([first], GREEDY, use_tqdm=False)[0]
    out_second = llm.generate([second], GREEDY, use_tqdm=False)[0]
    assert out_first.num_cached_tokens == 0 and out_second.num_cached_tokens == 40
    # Prompt, then one token per decode step but the last sampled one.
    assert counts["0"] == len(first) + 9
    assert counts["1"] == 2 + 9  # 40 prompt tokens came from the cache
    stats = llm.llm_engine.kv_cache_manager.prefix_cache_stats
    assert stats.hits == 40 and stats.queries == len(first) + len(second)
    assert out_first.outputs[0].token_ids == hf_greedy(model, first, 10), name
    assert out_second.outputs[0].token_ids == hf_greedy(model, second, 10), name
    assert_pool_full(llm)


def test_reset_prefix_cache_makes_a_prompt_compute_again(family):
    name, model, folder = family
    llm = LLM(folder, dtype="float32", block_size=4, kv_cache_space=0.05)
    prompt = PREFIX + [7, 8, 9]
    first = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].num_cached_tokens == 40
    assert llm.reset_prefix_cache()
    counts = count_computed_tokens(llm)
    again = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0 and counts["2"] == len(prompt) + 9
    assert again.outputs[0].token_ids == first.outputs[0].token_ids == hf_greedy(model, prompt, 10), name
    assert_pool_full(llm)


def test_reset_prefix_cache_refuses_while_a_request_holds_blocks(family):
    _, _, folder = family
    llm = LLM(folder, dtype="float32", block_size=4, kv_cache_space=0.05)
    engine = llm.llm_engine
    engine.add_request("held", PREFIX, GREEDY)
    engine.step()  # the prompt is computed and cached; the request runs on
    cached = dict(engine.kv_cache_manager.pool.cached_block_hash_to_block)
    assert cached and not llm.reset_prefix_cache()
    assert engine.kv_cache_manager.pool.cached_block_hash_to_block == cached  # nothing changed
    while engine.has_unfinished_requests():
        engine.step()
    assert llm.reset_prefix_cache()
    assert not engine.kv_cache_manager.pool.cached_block_hash_to_block
    assert_pool_full(llm)


@pytest.mark.parametrize("preempt", [False, True], ids=["roomy", "preempting"])
def test_outputs_identical_with_caching_on_and_off(family, preempt):
    name, model, folder = family
    # 20 blocks of 4 tokens: far less than the batch needs at once.
    pool = dict(num_gpu_blocks_override=20) if preempt else dict(kv_cache_space=0.05)
    results, computed = {}, {}
    for caching in (True, False):
        llm = LLM(folder, dtype="float32", block_size=4, max_num_batched_tokens=24, enable_prefix_caching=caching, **pool)
        counts = count_computed_tokens(llm)
        results[caching] = [o.outputs[0].token_ids for o in llm.generate(SHARED, GREEDY, use_tqdm=False)]
        computed[caching] = sum(counts.values())
        if preempt:
            assert llm.llm_engine.scheduler.num_preemptions > 0
        assert_pool_full(llm)
    assert results[True] == results[False]
    for prompt, tokens in zip(SHARED, results[True]):
        assert tokens == hf_greedy(model, prompt, 10), f"{name}: prompt {prompt}"
    assert computed[True] < computed[False]


def test_prompt_logprobs_skip_the_cache(family):
    name, model, folder = family
    llm = LLM(folder, dtype="float32", block_size=4, kv_cache_space=0.05)
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1, ignore_eos=True)
    cold = llm.generate([PREFIX + [1, 2]], params, use_tqdm=False)[0]
    warm = llm.generate([PREFIX + [1, 2]], params, use_tqdm=False)[0]
    assert warm.num_cached_tokens == 0
    assert len(warm.prompt_logprobs) == len(PREFIX) + 2
    for a, b in zip(cold.prompt_logprobs[1:], warm.prompt_logprobs[1:]):
        assert a.keys() == b.keys()
        for token in a:
            assert a[token].logprob == pytest.approx(b[token].logprob, abs=1e-5)
    assert_pool_full(llm)


def test_priority_serves_an_important_late_request_first(family):
    name, model, folder = family
    llm = LLM(folder, dtype="float32", kv_cache_space=0.05, max_num_seqs=1, scheduling_policy="priority")
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    engine.add_request("low1", [1, 2, 3], params, priority=5)
    engine.add_request("low2", [4, 5, 6], params, priority=5)
    engine.step()
    engine.add_request("high", [7, 8, 9], params, priority=0)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["low1", "high", "low2"]
    # LLM.generate takes one priority per prompt.
    outputs = llm.generate([[1, 2], [3, 4], [5, 6]], params, use_tqdm=False, priority=[3, 3, 0])
    order = sorted(outputs, key=lambda o: o.metrics.first_scheduled_time)
    assert [o.prompt_token_ids for o in order] == [[5, 6], [1, 2], [3, 4]]
    assert_pool_full(llm)
