"""The multi-process executor on a CUDA GPU: one worker process (NCCL
initialized for a world of one, the CUDA model runner, CUDA graphs
captured there) gives the same greedy tokens and logprobs as the model in
process, for every family; the KV pool is whole afterwards and no worker
outlives shutdown. Two ranks need a second GPU (issue 18)."""

import pytest

from pagoda import LLM, SamplingParams

PROMPTS = [[5, 9, 200, 17], [1], list(range(33, 50)), [250, 3], [7] * 30, list(range(60, 100))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)


def run(folder, **kwargs):
    llm = LLM(folder, dtype="bfloat16", device="cuda", skip_tokenizer_init=True, multiprocess=False, kv_cache_space=0.05, **kwargs)
    try:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        kv = llm.llm_engine.kv_cache_manager
        assert kv.num_free_blocks == kv.pool.num_blocks, "KV blocks leaked"
        workers = list(getattr(llm.llm_engine.core.executor, "processes", []))
        return [(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob) for o in outputs], workers
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_mp_executor_equals_in_process(family, enforce_eager, reference):
    folder = reference(family).folder
    in_process, _ = run(folder, enforce_eager=enforce_eager)
    through_worker, workers = run(folder, enforce_eager=enforce_eager, distributed_executor_backend="mp")
    assert [t for t, _ in through_worker] == [t for t, _ in in_process]
    for (_, a), (_, b) in zip(through_worker, in_process):
        assert a == pytest.approx(b, abs=1e-3)  # the same kernels on the same device
    assert workers and not any(p.is_alive() for p in workers), "a worker outlived shutdown"
