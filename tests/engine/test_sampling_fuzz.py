"""Hypothesis drives SamplingParams through LLM.generate with values a
hostile client could send -- NaN and infinities, floats past float32, ints
past int64, ids past the vocabulary, wrong types -- in every field at once.
Each request is refused with a ValueError when it is built or added, or it
is served without failing inside the engine; afterwards the engine serves a
plain request and the KV pool is whole again."""

import math

import pytest
from checkpoints import VOCAB
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagoda import LLM, SamplingParams
from pagoda.sampling_params import DEFAULTS

edge_ints = st.sampled_from([0, 1, 2, -1, -2, VOCAB - 1, VOCAB, 2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63),
                             -(2**63) - 1, 10**30])
edge_floats = st.sampled_from([0.0, 1e-45, 1e-300, 5e-324, 0.5, 1.0, 2.0, 100.0, 1e4, 3.4e38, 1e308, -1e308,
                               math.inf, -math.inf, math.nan, -0.0])
anything = st.one_of(st.none(), st.booleans(), st.text(max_size=3), edge_ints, edge_floats,
                     st.lists(edge_ints, max_size=3))
token_ids = st.one_of(st.integers(0, VOCAB - 1), edge_ints)
# Ids past the vocabulary that still fit an int64.
out_of_vocab = st.sampled_from([VOCAB, VOCAB + 1, 999_999, 2**31, 2**63 - 1])
unit = st.floats(0, 1)

# Per field: (values a client would send, hostile values of the right type).
FIELDS = {
    "n": (st.integers(1, 3), edge_ints),
    "temperature": (st.floats(0, 2), edge_floats), "top_p": (unit, edge_floats), "min_p": (unit, edge_floats),
    "top_k": (st.integers(-1, VOCAB + 5), edge_ints),
    "presence_penalty": (st.floats(-2, 2), edge_floats), "frequency_penalty": (st.floats(-2, 2), edge_floats),
    "repetition_penalty": (st.floats(0.5, 2), edge_floats),
    "seed": (st.integers(0, 2**32), st.one_of(edge_ints, st.integers())),
    "stop": (st.lists(st.text(min_size=1, max_size=3), max_size=2), st.one_of(st.text(max_size=3), edge_ints)),
    "stop_token_ids": (st.lists(st.integers(0, VOCAB - 1), max_size=3),
                       st.lists(st.integers(0, VOCAB - 1) | out_of_vocab, max_size=2).map(lambda ids: ids + [999_999])),
    "ignore_eos": (st.booleans(), anything), "include_stop_str_in_output": (st.booleans(), anything),
    "skip_special_tokens": (st.booleans(), anything),
    "max_tokens": (st.integers(1, 8), st.one_of(st.none(), edge_ints)),
    "min_tokens": (st.integers(0, 3), edge_ints),
    "logprobs": (st.integers(0, 5), edge_ints), "prompt_logprobs": (st.integers(0, 5), edge_ints),
    "logit_bias": (st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-100, 100), max_size=3),
                   st.dictionaries(token_ids | out_of_vocab, edge_floats, min_size=1, max_size=3)),
    "timeout_seconds": (st.floats(1, 60), edge_floats),
}
assert set(FIELDS) <= set(DEFAULTS)


def accepted(name, value) -> bool:
    try:
        SamplingParams(**{name: value})
        return True
    except ValueError:
        return False


# The hostile values that pass SamplingParams' own checks are the ones that
# test the engine (the others are test_sampling_params.py's).
FIELDS = {name: (sane, hostile.filter(lambda v, name=name: accepted(name, v))) for name, (sane, hostile) in FIELDS.items()}


KINDS = st.sampled_from(["unset"] * 10 + ["sane"] * 6 + ["hostile"] * 3 + ["anything"])


@st.composite
def requests(draw):
    """About half the fields set, most with a sane value, some with a
    hostile one that passes SamplingParams' checks, a few with anything at
    all: many requests reach the engine with hostile values among sane ones."""
    kwargs = {}
    for name, (sane, hostile) in FIELDS.items():
        kind = draw(KINDS)
        if kind != "unset":
            kwargs[name] = draw({"sane": sane, "hostile": hostile, "anything": anything}[kind])
    prompt = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6) | st.lists(token_ids, min_size=1, max_size=3))
    return kwargs, prompt


@pytest.fixture(scope="module")
def llm(make_checkpoint):
    return LLM(make_checkpoint("llama")[1], dtype="float32", kv_cache_space=0.05, max_num_seqs=8)


@settings(max_examples=200, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(requests())
def test_hostile_sampling_params_fail_alone_or_are_served(llm, request_):
    kwargs, prompt = request_
    engine = llm.llm_engine
    try:
        params = SamplingParams(**kwargs)
        # Fuzzing covers the values, not waiting for 128-token generations.
        if params.max_tokens is None or params.max_tokens > 8:
            params.max_tokens, params.min_tokens = 8, min(params.min_tokens, 8)
        outputs = llm.generate([prompt], params, use_tqdm=False)
    except ValueError:
        pass  # refused at admission, naming the field
    else:
        assert outputs[0].finished and outputs[0].error is None, outputs[0].error
    assert engine.kv_cache_manager.num_free_blocks == engine.runner.num_blocks, "KV blocks leaked"
    assert not engine.has_unfinished_requests()
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 2
