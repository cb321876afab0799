"""Sampling, stopping and bad input through the whole engine (a tiny random
Llama; prompts as token ids): seeded requests reproduce in any batch, n > 1,
logprobs, stops, errors that name the field, and no KV block is ever leaked."""

import pytest
import torch

from pagoda import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(make_checkpoint):
    model, folder = make_checkpoint("llama")
    llm = LLM(folder, dtype="float32", kv_cache_space=0.05, max_num_seqs=4)
    llm.hf_model = model
    yield llm
    kv = llm.llm_engine.kv_cache_manager
    assert kv.num_free_blocks == llm.llm_engine.runner.num_blocks, "KV blocks leaked"


def tokens(output, index=0):
    return output.outputs[index].token_ids


def test_seeded_sampling_reproduces_in_any_batch(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=10, ignore_eos=True)
    alone = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0]
    crowd = llm.generate(
        [[1, 2], [5, 6, 7], [9] * 20, [3, 4, 5, 6]],
        [SamplingParams(temperature=0.8, max_tokens=7, ignore_eos=True), params,
         SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True), SamplingParams(temperature=0.0, max_tokens=3)],
        use_tqdm=False,
    )
    assert tokens(crowd[1]) == tokens(alone)
    other_seed = llm.generate([[5, 6, 7]], SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=10, ignore_eos=True), use_tqdm=False)[0]
    assert tokens(other_seed) != tokens(alone)


def test_n_completions_are_independent_and_reproducible(llm):
    params = SamplingParams(n=3, temperature=1.5, seed=5, max_tokens=8, ignore_eos=True)
    first = llm.generate([[10, 11, 12]], params, use_tqdm=False)[0]
    again = llm.generate([[10, 11, 12]], params, use_tqdm=False)[0]
    assert [o.index for o in first.outputs] == [0, 1, 2]
    assert [tokens(first, i) for i in range(3)] == [tokens(again, i) for i in range(3)]
    assert len({tuple(tokens(first, i)) for i in range(3)}) > 1


def test_greedy_logprobs_match_the_model(llm):
    prompt = [40, 41, 42, 43]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=5, logprobs=3, ignore_eos=True), use_tqdm=False)[0]
    completion = out.outputs[0]
    assert len(completion.logprobs) == 5
    ids = torch.tensor([prompt + completion.token_ids[:-1]])
    with torch.no_grad():
        reference = torch.log_softmax(llm.hf_model(ids).logits[0, len(prompt) - 1 :].float(), dim=-1)
    for step, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        assert entry[token].rank == 1
        assert len(entry) == 3  # the chosen token is among the top 3
        assert entry[token].logprob == pytest.approx(reference[step, token].item(), abs=1e-4)
    assert completion.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(completion.token_ids, completion.logprobs)))


@pytest.mark.parametrize("chunk", [4096, 3])
def test_prompt_logprobs_match_the_model(llm, chunk):
    prompt = [70, 71, 72, 73, 74, 75, 76, 77]
    engine = llm.llm_engine
    engine.scheduler.max_num_batched_tokens, saved = chunk, engine.scheduler.max_num_batched_tokens
    try:
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2), use_tqdm=False)[0]
    finally:
        engine.scheduler.max_num_batched_tokens = saved
    with torch.no_grad():
        reference = torch.log_softmax(llm.hf_model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for position in range(1, len(prompt)):
        entry = out.prompt_logprobs[position]
        token = prompt[position]
        assert entry[token].logprob == pytest.approx(reference[position - 1, token].item(), abs=1e-4)
        top = reference[position - 1].topk(2).indices.tolist()
        assert set(top) <= set(entry)


def test_stop_token_ids_and_min_tokens(llm):
    greedy = llm.generate([[50, 51]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)[0]
    stop_at = tokens(greedy)[3]
    first = tokens(greedy).index(stop_at)
    stopped = llm.generate([[50, 51]], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_at]), use_tqdm=False)[0]
    assert stopped.outputs[0].finish_reason == "stop" and stopped.outputs[0].stop_reason == stop_at
    assert tokens(stopped) == tokens(greedy)[: first + 1]
    held = llm.generate([[50, 51]], SamplingParams(temperature=0, max_tokens=10, min_tokens=10, stop_token_ids=[stop_at]), use_tqdm=False)[0]
    assert len(tokens(held)) == 10 and held.outputs[0].finish_reason == "length"


def test_stop_string_cuts_the_text(llm):
    greedy = llm.generate([[60, 61]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    text = greedy.outputs[0].text
    stop = text[3:6]
    assert stop and stop in text
    out = llm.generate([[60, 61]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop]), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert out.outputs[0].text == text[: text.index(stop)]


def test_more_requests_than_max_num_seqs(llm):
    prompts = [[i, i + 1] for i in range(1, 30)]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == prompts
    assert all(len(tokens(o)) == 4 for o in outputs)


def test_max_model_len_ends_with_length(llm):
    limit = llm.llm_engine.model_config.max_model_len
    out = llm.generate([[1] * (limit - 3)], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), use_tqdm=False)[0]
    assert len(tokens(out)) == 3 and out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize(
    "prompt,params,field",
    [
        ([1] * 500, SamplingParams(), "max_model_len"),
        ([], SamplingParams(), "empty"),
        ([1, 99999], SamplingParams(), "prompt_token_ids"),
        ([1, 2], SamplingParams(logit_bias={99999: 1.0}), "logit_bias"),
        ({"text": "x"}, SamplingParams(), "prompt_token_ids"),
    ],
)
def test_bad_requests_raise_value_error(llm, prompt, params, field):
    with pytest.raises(ValueError, match=field):
        llm.generate([prompt], params, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_invalid_sampling_params_name_the_field():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)


def test_abort_frees_blocks(llm):
    engine = llm.llm_engine
    engine.add_request("to-abort", [1, 2, 3] * 10, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    assert engine.kv_cache_manager.num_free_blocks < engine.runner.num_blocks
    engine.abort_request("to-abort")
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache_manager.num_free_blocks == engine.runner.num_blocks


def test_deadline_ends_a_slow_request_with_its_partial_text(llm, monkeypatch):
    import time

    engine = llm.llm_engine
    execute = engine.runner.execute

    def slow_execute(*args, **kwargs):
        time.sleep(0.05)  # 1000 tokens would take 50 s
        return execute(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "execute", slow_execute)
    started = time.monotonic()
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=1000, ignore_eos=True, timeout_seconds=1.0), use_tqdm=False)[0]
    elapsed = time.monotonic() - started
    completion = out.outputs[0]
    assert completion.finish_reason == "timeout"
    assert 0 < len(completion.token_ids) < 1000
    assert elapsed < 1.0 + 0.5  # the deadline plus about one step
    assert out.finished


def test_mismatched_params_list_is_rejected(llm):
    with pytest.raises(ValueError, match="sampling_params has 2 entries for 1 prompts"):
        llm.generate([[1, 2]], [SamplingParams(), SamplingParams()], use_tqdm=False)
