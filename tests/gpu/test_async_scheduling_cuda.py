"""Async scheduling, the GPU's default: the same tokens as one step at a time
with CUDA graphs -- greedy, and seeded sampling in the CUDA kernel, whose
Philox offsets must count the samples still in flight -- and queuing a step
never waits for the GPU (torch's sync debug mode raises on any synchronizing
call inside it)."""

import pytest
import torch

from pagoda import LLM, SamplingParams

PROMPTS = [[5, 9, 200, 17], [1], list(range(33, 50)), [250, 3], [7] * 30, [100, 101, 102], list(range(60, 100)),
           [12, 13]]
STOP = 77
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=3, max_tokens=24, ignore_eos=True),
    # The stop token is all but certain once min_tokens allows it: ends at exactly 7 tokens, a step late.
    SamplingParams(temperature=1.0, min_p=0.05, seed=11, max_tokens=10, min_tokens=6, stop_token_ids=[STOP],
                   logit_bias={STOP: 100}),
    SamplingParams(temperature=0.7, seed=5, max_tokens=3, presence_penalty=0.5, ignore_eos=True),
    SamplingParams(n=2, temperature=1.2, seed=9, max_tokens=16, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1),
    SamplingParams(temperature=1.0, seed=21, max_tokens=40, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=33, ignore_eos=True),
]


def make_llm(ref, async_scheduling):
    # float32: the two runs batch differently (a stopped request spends one
    # more row), and bf16 GEMMs of other shapes could flip a near-tie.
    return LLM(ref.folder, dtype="float32", device="cuda", skip_tokenizer_init=True, multiprocess=False, max_num_seqs=16,
               async_scheduling=async_scheduling)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_tokens_equal_one_step_at_a_time(family, reference):
    ref = reference(family)
    sync = make_llm(ref, async_scheduling=False)
    want = sync.generate(PROMPTS, PARAMS, use_tqdm=False)
    del sync
    overlapped = make_llm(ref, async_scheduling=None)  # the default on CUDA
    assert overlapped.llm_engine.async_scheduling is True
    got = overlapped.generate(PROMPTS, PARAMS, use_tqdm=False)
    for w, g in zip(want, got):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs]
        assert [c.finish_reason for c in g.outputs] == [c.finish_reason for c in w.outputs]
        for cw, cg in zip(w.outputs, g.outputs):
            if cw.logprobs:
                assert cg.cumulative_logprob == pytest.approx(cw.cumulative_logprob, abs=1e-3)
    assert len(got[2].outputs[0].token_ids) == 7
    kv = overlapped.llm_engine.kv_cache_manager
    assert kv.num_free_blocks == overlapped.llm_engine.runner.num_blocks, "KV blocks leaked"


def test_queuing_a_step_never_waits_for_the_gpu(reference):
    llm = make_llm(reference("qwen3"), async_scheduling=True)
    engine = llm.llm_engine.core
    launch, launched = engine._launch, []

    def strict(scheduled):
        torch.cuda.set_sync_debug_mode("error")
        try:
            launched.append(launch(scheduled))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return launched[-1]

    engine._launch = strict
    llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert len(launched) > 30
