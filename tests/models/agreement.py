"""How closely a quantized path follows the unquantized one: greedy tokens
equal up to the first near tie, and the prompts' logprobs close.

A model's greedy path often passes near ties (SmolLM2 in bf16 parts from
fp32 within 2 tokens on some chat prompts, at gaps of 0.06 nats), so a
quantized path cannot be held to equal tokens; what it can be held to is
that where it parts from the reference, the reference's token was almost as
likely to it (within near_tie of its top logprob), and that the logprobs of
the prompts' own tokens move by less than max_drift on average."""

from __future__ import annotations


def first_difference(got: list[int], want: list[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)


def assert_agree_up_to_near_tie(got, want, near_tie: float, max_drift: float) -> float:
    """got, want: RequestOutputs of the same prompt, sampled greedily with
    logprobs (enough to hold the reference's token at a tie) and
    prompt_logprobs=0. Returns the mean drift of the prompt's logprobs."""
    got_ids, want_ids = got.outputs[0].token_ids, want.outputs[0].token_ids
    first = first_difference(got_ids, want_ids)
    if first is not None:
        top = got.outputs[0].logprobs[first]
        assert want_ids[first] in top, (got.prompt, first)
        assert top[got_ids[first]].logprob - top[want_ids[first]].logprob < near_tie, (got.prompt, first)
    drift = [
        abs(next(iter(a.values())).logprob - next(iter(b.values())).logprob)
        for a, b in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:])
    ]
    mean = sum(drift) / len(drift) if drift else 0.0  # a one-token prompt has no logprob to compare
    assert mean < max_drift, (got.prompt, mean)
    return mean
