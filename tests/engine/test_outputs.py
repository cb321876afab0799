from pagoda.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput


def test_vllm_attribute_names_and_repr():
    c = CompletionOutput(index=0, text="hi", token_ids=list(range(40)), cumulative_logprob=-1.5,
                         logprobs=[{3: Logprob(-0.1, 1, "a")}], finish_reason="length")
    assert c.finished() and c.stop_reason is None
    assert not CompletionOutput(index=1, text="", token_ids=[]).finished()
    m = RequestMetrics(arrival_time=10.0, first_token_time=10.25)
    assert m.time_to_first_token == 0.25
    r = RequestOutput(request_id="r1", prompt="p", prompt_token_ids=[1, 2], prompt_logprobs=None,
                      outputs=[c], finished=True, metrics=m)
    for name in ("request_id", "prompt", "prompt_token_ids", "prompt_logprobs", "outputs", "finished", "metrics"):
        assert hasattr(r, name)
    text = repr(r)
    assert "request_id='r1'" in text and "text='hi'" in text and "more" in text and "<1 positions>" in text
    assert Logprob(-1.0) == Logprob(logprob=-1.0, rank=None, decoded_token=None)
