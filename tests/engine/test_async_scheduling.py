"""Async scheduling (each step queued before the previous one's samples are
read; the GPU default) gives exactly the outputs of one-step-at-a-time
scheduling: greedy and seeded tokens, text, stops found a step late, logprobs,
penalties, n > 1, chunked prefill, preemption and max_model_len -- with its
pending input tokens really filled from the previous step's samples, results
arriving one step later, and no KV block leaked by requests that end or are
aborted while a step is in flight. On the CPU the "device" is the CPU, so the
same code paths run here."""

import pytest

from pagoda import LLM, SamplingParams

PROMPTS = [[5, 9, 200, 17], [1], list(range(33, 50)), [250, 3], [7] * 30, [100, 101, 102], list(range(60, 100)),
           [12, 13]]


def mixed_params(stop_token_id):
    """Every feature whose result async scheduling could shift; random rows seeded."""
    return [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=3, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[stop_token_id]),  # stops early
        # The stop token is all but certain once min_tokens allows it: ends at exactly 7 tokens.
        SamplingParams(temperature=1.0, min_p=0.05, seed=11, max_tokens=10, min_tokens=6, stop_token_ids=[stop_token_id],
                       logit_bias={stop_token_id: 100}),
        # Penalties need every id on the host: steps run one at a time while it runs (short, so the rest overlap).
        SamplingParams(temperature=0.7, seed=5, max_tokens=3, presence_penalty=0.5, repetition_penalty=1.3,
                       ignore_eos=True),
        SamplingParams(n=2, temperature=1.2, seed=9, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1),
        SamplingParams(temperature=0.0, max_tokens=20, stop=["o"]),  # a stop string
    ]


def summary(outputs):
    return [
        (o.prompt_logprobs is not None and [None if e is None else sorted(e) for e in o.prompt_logprobs],
         [(c.token_ids, c.text, c.finish_reason, c.logprobs and [sorted(e) for e in c.logprobs]) for c in o.outputs])
        for o in outputs
    ]


def count_pending_inputs(llm):
    """Wraps the runner: counts the inputs filled from the previous step's samples."""
    runner, seen = llm.llm_engine.runner, []
    execute = runner.execute

    def counting(scheduled, *args, **kwargs):
        seen.append(sum(item.last_token_pending for item in scheduled.scheduled))
        return execute(scheduled, *args, **kwargs)

    runner.execute = counting
    return seen


def assert_pool_full(llm):
    assert llm.llm_engine.kv_cache_manager.num_free_blocks == llm.llm_engine.runner.num_blocks, "KV blocks leaked"


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint):
    return make_checkpoint("llama")[1]


@pytest.mark.parametrize(
    "engine_args",
    [
        dict(kv_cache_space=0.05),
        dict(kv_cache_space=0.05, max_num_batched_tokens=7, max_num_seqs=3),  # chunked prefill
        dict(block_size=4, num_gpu_blocks_override=24),  # preemption
        dict(kv_cache_space=0.05, max_model_len=44),  # "length" from max_model_len
    ],
    ids=["plain", "chunked", "preempted", "max_model_len"],
)
def test_outputs_equal_one_step_at_a_time(checkpoint, engine_args):
    sync = LLM(checkpoint, dtype="float32", async_scheduling=False, **engine_args)
    overlapped = LLM(checkpoint, dtype="float32", async_scheduling=True, **engine_args)
    tokenizer = sync.get_tokenizer()
    params = mixed_params(tokenizer.convert_tokens_to_ids("o"))
    pending = count_pending_inputs(overlapped)
    want = sync.generate(PROMPTS, params, use_tqdm=False)
    got = overlapped.generate(PROMPTS, params, use_tqdm=False)
    assert summary(got) == summary(want)
    for w, g in zip(want, got):
        for cw, cg in zip(w.outputs, g.outputs):
            assert cg.cumulative_logprob == pytest.approx(cw.cumulative_logprob, abs=1e-4)
    assert sum(pending) > len(PROMPTS), "decode inputs were not taken from the previous step's samples"
    assert len(got[3].outputs[0].token_ids) == 7 or "max_model_len" in engine_args
    if "num_gpu_blocks_override" in engine_args:
        assert overlapped.llm_engine.scheduler.num_preemptions > 0
    if "max_model_len" in engine_args:
        assert any(c.finish_reason == "length" and len(o.prompt_token_ids) + len(c.token_ids) == 44
                   for o in got for c in o.outputs)
    assert_pool_full(sync)
    assert_pool_full(overlapped)


def test_results_arrive_one_step_later(checkpoint):
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    got = {}
    for async_scheduling in (False, True):
        engine = LLM(checkpoint, dtype="float32", kv_cache_space=0.05, async_scheduling=async_scheduling).llm_engine
        engine.add_request("r", [5, 9, 200], params)
        got[async_scheduling] = [[len(o.outputs[0].token_ids) for o in engine.step()] for _ in range(4)]
        assert not engine.has_unfinished_requests()
    assert got[False] == [[1], [2], [3], []]
    assert got[True] == [[], [1], [2], [3]]  # the step that read token 3 queued nothing


def test_abort_with_a_step_in_flight_frees_blocks_and_the_id(checkpoint):
    llm = LLM(checkpoint, dtype="float32", kv_cache_space=0.05, async_scheduling=True)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    engine.add_request("r", [5, 9, 200, 17], params)
    engine.add_request("other", [250, 3], params)
    for _ in range(3):
        engine.step()
    engine.abort_request("r")
    # The same id again at once: the aborted request's in-flight token must not reach it.
    short = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine.add_request("r", [1, 2, 3], short)
    finished = {}
    while engine.has_unfinished_requests():
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    alone = LLM(checkpoint, dtype="float32", kv_cache_space=0.05, async_scheduling=False).generate(
        [[1, 2, 3]], short, use_tqdm=False)[0]
    assert finished["r"].outputs[0].token_ids == alone.outputs[0].token_ids
    assert len(finished["other"].outputs[0].token_ids) == 50
    assert_pool_full(llm)


def test_off_by_default_on_the_cpu_and_logged(checkpoint, caplog):
    with caplog.at_level("INFO", logger="pagoda.engine.arg_utils"):
        engine = LLM(checkpoint, dtype="float32", kv_cache_space=0.05).llm_engine
    assert engine.async_scheduling is False
    assert any("(async scheduling off)" in r.getMessage() for r in caplog.records)


def test_a_bad_value_names_the_field(checkpoint):
    with pytest.raises(ValueError, match="async_scheduling"):
        LLM(checkpoint, dtype="float32", kv_cache_space=0.05, async_scheduling="yes")


def test_penalties_read_every_id_before_the_next_step(checkpoint):
    """Penalties count the ids generated so far: while such a request is in
    flight no step is scheduled ahead of its samples (no pending inputs)."""
    params = SamplingParams(temperature=0.8, seed=2, max_tokens=10, frequency_penalty=1.5, repetition_penalty=2.0,
                            ignore_eos=True)
    want = LLM(checkpoint, dtype="float32", kv_cache_space=0.05, async_scheduling=False).generate(
        PROMPTS[:3], params, use_tqdm=False)
    overlapped = LLM(checkpoint, dtype="float32", kv_cache_space=0.05, async_scheduling=True)
    pending = count_pending_inputs(overlapped)
    got = overlapped.generate(PROMPTS[:3], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert len(pending) >= 10 and sum(pending) == 0
