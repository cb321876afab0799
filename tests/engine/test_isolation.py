"""A request fails alone: hostile values are refused when a request is added;
a failure inside a step that one request explains (injected through the
engine's fault_hook, at each stage of the step) ends that request with
finish_reason "error" and frees its blocks, while every other request gets
exactly the tokens it gets without the fault; a failure no request explains
still propagates. The KV cache always holds one sequence of max_model_len."""

import asyncio
import logging

import pytest

from pagoda import LLM, SamplingParams
from pagoda.engine.async_llm import AsyncLLM, RequestFailedError

PROMPTS = [[5, 9, 200, 17], [1, 2, 3], list(range(60, 90)), [250, 3], [7] * 12]
VICTIM = 2  # the prompt whose request the fault hits
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
    SamplingParams(temperature=0.8, seed=11, max_tokens=10, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=1.0, seed=5, n=2, max_tokens=10, ignore_eos=True, top_k=20),
    SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, min_tokens=3, stop_token_ids=[4]),
    SamplingParams(temperature=0.7, seed=3, top_p=0.9, max_tokens=10, ignore_eos=True),
]


@pytest.fixture(scope="module")
def folder(make_checkpoint):
    return make_checkpoint("llama")[1]


def make_llm(folder, **kwargs):
    return LLM(folder, dtype="float32", kv_cache_space=0.05, max_num_seqs=8, **kwargs)


def assert_pool_full(llm):
    engine = llm.llm_engine
    assert engine.kv_cache_manager.num_free_blocks == engine.runner.num_blocks, "KV blocks leaked"
    assert not engine.output_processor.states and not engine.output_processor.parents
    assert not engine.core.sequences
    # The worker forgets ended requests when the next step tells it to.
    assert set(engine.worker.requests) == set(engine.scheduler.finished_ids_to_send)


def tokens(output):
    return [c.token_ids for c in output.outputs]


class InjectedFault(Exception):
    pass


def fail_request(stage: str, victim_id: str, after_calls: int = 0):
    """A fault_hook raising where `stage` works on the victim (from its
    (after_calls+1)-th such call on: mid-generation, not only at the start)."""
    seen = []

    def hook(hook_stage, request_ids):
        if hook_stage == stage and any(i.endswith(victim_id) for i in request_ids):
            seen.append(request_ids)
            if len(seen) > after_calls:
                raise InjectedFault(f"injected into {stage}")

    return hook


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("stage,after_calls", [("prepare", 0), ("sample", 3), ("output", 4)])
def test_a_fault_in_one_request_fails_it_alone(folder, stage, after_calls, async_scheduling, caplog):
    llm = make_llm(folder, async_scheduling=async_scheduling)
    expected = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    victim_id = str(len(PROMPTS) + VICTIM)  # LLM numbers requests on: the second batch starts at len(PROMPTS)
    llm.llm_engine.fault_hook = fail_request(stage, victim_id, after_calls)
    with caplog.at_level(logging.ERROR, logger="pagoda.engine"):
        outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    for i, (want, got) in enumerate(zip(expected, outputs)):
        if i == VICTIM:
            assert got.finished and got.error is not None and "InjectedFault" in got.error and stage in got.error
            assert {c.finish_reason for c in got.outputs} == {"error"}
        else:
            assert got.error is None
            assert tokens(got) == tokens(want), f"prompt {i}: the fault changed another request's tokens"
    assert f"failed in the step's {stage} stage" in caplog.text
    assert_pool_full(llm)
    # The engine serves on.
    llm.llm_engine.fault_hook = None
    assert tokens(llm.generate(PROMPTS[:1], PARAMS[0], use_tqdm=False)[0]) == tokens(expected[0])


def test_a_fault_no_single_request_explains_propagates(folder):
    llm = make_llm(folder)

    def batch_only(stage, request_ids):
        if stage == "sample" and len(request_ids) > 1:
            raise InjectedFault("only the batch fails")

    llm.llm_engine.fault_hook = batch_only
    with pytest.raises(InjectedFault):
        llm.generate(PROMPTS, PARAMS[0], use_tqdm=False)


def test_the_issue_examples_are_refused_or_served(folder):
    """The bodies that used to kill the engine: refused at admission with
    the field named, or served (top_k past the vocabulary means off)."""
    llm = make_llm(folder)
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate(["hi"], SamplingParams(min_tokens=1, max_tokens=4, stop_token_ids=[999999]), use_tqdm=False)
    for bad in (dict(temperature=3.4e38), dict(top_k=2**70), dict(logit_bias={1: float("nan")})):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)
    served = [SamplingParams(top_k=10**9, max_tokens=4), SamplingParams(top_p=1e-45, max_tokens=4),
              SamplingParams(seed=2**64 - 1, n=2, max_tokens=4), SamplingParams(seed=-(2**63), n=3, max_tokens=4),
              SamplingParams(temperature=1e4, max_tokens=4)]
    outputs = llm.generate([[5, 6, 7]] * len(served), served, use_tqdm=False)
    assert all(o.error is None and all(len(c.token_ids) == 4 for c in o.outputs) for o in outputs)
    assert_pool_full(llm)


def test_async_llm_fails_the_request_alone(folder):
    from pagoda.engine.async_llm import AsyncLLM

    engine = AsyncLLM(folder, dtype="float32", kv_cache_space=0.05, disable_log_stats=True)
    engine.engine.fault_hook = fail_request("sample", "victim", after_calls=2)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    async def run(request_id):
        last = None
        async for out in engine.generate([5, 6, 7], params, request_id):
            last = out
        return last

    async def main():
        return await asyncio.gather(run("victim"), run("a"), run("b"), return_exceptions=True)

    try:
        victim, a, b = asyncio.run(main())
        assert isinstance(victim, RequestFailedError) and "InjectedFault" in str(victim)
        assert len(a.outputs[0].token_ids) == 8 and a.outputs[0].token_ids == b.outputs[0].token_ids
        engine.check_health()
        assert engine.engine.kv_cache_manager.num_free_blocks == engine.engine.runner.num_blocks
    finally:
        engine.shutdown()


def test_max_model_len_must_fit_the_kv_cache(folder):
    # 6 blocks of 4 tokens hold 24 tokens; the model's own limit is 128.
    with pytest.raises(ValueError, match=r"max_model_len=64 does not fit in the KV cache, which holds 24 tokens: "
                                         r"pass --max-model-len 24"):
        LLM(folder, dtype="float32", block_size=4, num_gpu_blocks_override=6, max_model_len=64)


def test_the_models_max_model_len_is_fitted_to_the_kv_cache(folder, caplog):
    with caplog.at_level(logging.WARNING, logger="pagoda.config"):
        llm = LLM(folder, dtype="float32", block_size=4, num_gpu_blocks_override=6)
    assert llm.llm_engine.model_config.max_model_len == 24
    assert "max_model_len lowered from the model's 128 to 24" in caplog.text
    # A lone request runs to the fitted limit and ends with "length", never stuck.
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=None, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 21
    assert_pool_full(llm)


def test_kv_exhaustion_preempts_and_every_request_completes(folder):
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    prompts = [[i + 3, i + 7, 11] * 4 for i in range(12)]
    want = make_llm(folder).generate(prompts, params, use_tqdm=False)
    # 16 blocks of 4 tokens: two sequences at most at full length.
    small = LLM(folder, dtype="float32", block_size=4, num_gpu_blocks_override=16, max_model_len=64)
    got = small.generate(prompts, params, use_tqdm=False)
    assert small.llm_engine.scheduler.num_preemptions > 0
    assert [tokens(o) for o in got] == [tokens(o) for o in want]
    assert_pool_full(small)
