"""A request fails alone on the GPU too (CUDA sampling kernel, CUDA graphs,
async scheduling): the sampling values that used to kill the engine are
refused or served beside ordinary requests without changing their tokens,
and a fault injected into one request's step (LLMEngine.fault_hook) ends
that request alone with finish_reason "error"."""

import pytest

from pagoda import LLM, SamplingParams

ORDINARY = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
            SamplingParams(temperature=0.9, top_k=40, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)]
PROMPTS = [[5, 9, 200, 17], list(range(60, 90))]
# Accepted at admission, each at an edge: they must sample in the same batch.
EDGES = [dict(top_k=10**9), dict(top_k=2**62), dict(top_p=1e-45), dict(top_p=5e-324), dict(min_p=1e-300),
         dict(temperature=1e4), dict(temperature=1e-300), dict(seed=2**64 - 1, n=3), dict(seed=-(2**63), n=2),
         dict(repetition_penalty=1e4), dict(repetition_penalty=1e-300), dict(presence_penalty=2, frequency_penalty=-2),
         dict(logit_bias={5: 1e4, 6: -1e4}), dict(min_tokens=3, stop_token_ids=[0, 1, 2, 3]), dict(logprobs=10**6),
         dict(prompt_logprobs=10**6, top_k=1)]


@pytest.fixture(scope="module")
def llm(reference, fp32_supported):
    if fp32_supported is not True:
        pytest.skip(f"the CUDA attention kernels take no float32: {fp32_supported}")
    # float32: the batches differ between runs, and bf16 GEMMs of other
    # shapes could flip a near-tie of the greedy rows.
    return LLM(reference("llama").folder, dtype="float32", device="cuda", skip_tokenizer_init=True, multiprocess=False,
               gpu_memory_utilization=0.3, max_num_seqs=32)


def tokens(output):
    return [c.token_ids for c in output.outputs]


def assert_pool_full(llm):
    engine = llm.llm_engine
    assert engine.kv_cache_manager.num_free_blocks == engine.runner.num_blocks, "KV blocks leaked"


def test_edge_values_sample_beside_ordinary_requests(llm):
    alone = llm.generate(PROMPTS, ORDINARY, use_tqdm=False)
    edges = [SamplingParams(max_tokens=6, ignore_eos=True, **kwargs) for kwargs in EDGES]
    outputs = llm.generate(PROMPTS + [[7, 8, 9]] * len(edges), ORDINARY + edges, use_tqdm=False)
    for want, got in zip(alone, outputs):
        assert tokens(got) == tokens(want)
    for kwargs, out in zip(EDGES, outputs[len(PROMPTS):]):
        assert out.error is None, (kwargs, out.error)
        assert all(len(c.token_ids) == 6 and all(0 <= t < 256 for t in c.token_ids) for c in out.outputs), kwargs
    assert_pool_full(llm)
    for bad in (dict(temperature=3.4e38), dict(top_k=2**70), dict(temperature=float("inf"))):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate([[1, 2]], SamplingParams(min_tokens=1, max_tokens=4, stop_token_ids=[999999]), use_tqdm=False)


@pytest.mark.parametrize("stage", ["prepare", "sample", "output"])
def test_a_fault_in_one_request_fails_it_alone(llm, stage):
    alone = llm.generate(PROMPTS, ORDINARY, use_tqdm=False)
    calls = []

    def hook(hook_stage, request_ids):
        if hook_stage == stage and any(i.endswith("victim") for i in request_ids):
            calls.append(request_ids)
            if len(calls) > 3:  # mid-generation, with steps queued ahead
                raise RuntimeError("injected")

    engine = llm.llm_engine
    engine.fault_hook = hook
    try:
        for i, (prompt, params) in enumerate(zip(PROMPTS, ORDINARY)):
            engine.add_request(f"ok{i}", prompt, params)
        engine.add_request("victim", [3, 4, 5], SamplingParams(n=2, seed=1, max_tokens=12, ignore_eos=True))
        final = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    final[out.request_id] = out
    finally:
        engine.fault_hook = None
    assert final["victim"].error is not None and "injected" in final["victim"].error
    for i, want in enumerate(alone):
        assert tokens(final[f"ok{i}"]) == tokens(want)
    assert_pool_full(llm)
