import copy
import pickle

import pytest

from pagoda.sampling_params import SamplingParams

# vLLM's SamplingParams defaults (best_of is not supported; stop/stop_token_ids
# normalised to lists as vLLM does).
VLLM_DEFAULTS = dict(
    n=1, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, temperature=1.0, top_p=1.0,
    top_k=0, min_p=0.0, seed=None, stop=[], stop_token_ids=[], ignore_eos=False, max_tokens=16, min_tokens=0,
    logprobs=None, prompt_logprobs=None, detokenize=True, skip_special_tokens=True,
    spaces_between_special_tokens=True, include_stop_str_in_output=False, logit_bias=None,
)


def test_defaults_match_vllm():
    p = SamplingParams()
    for name, value in VLLM_DEFAULTS.items():
        assert getattr(p, name) == value, name
    assert p.timeout_seconds is None
    assert not hasattr(p, "best_of") and not hasattr(p, "priority")
    assert p.explicit_fields == frozenset()


@pytest.mark.parametrize("field,value", [
    ("n", 0), ("n", 1.5), ("n", True),
    ("temperature", -1.0), ("temperature", "hot"),
    ("top_p", 0.0), ("top_p", 1.5),
    ("top_k", -2), ("top_k", 1.5),
    ("min_p", -0.1), ("min_p", 1.1),
    ("presence_penalty", 2.5), ("presence_penalty", -2.1),
    ("frequency_penalty", 3.0), ("frequency_penalty", -3.0),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
    ("seed", 1.5), ("seed", "7"), ("seed", 2**64), ("seed", -(2**63) - 1),
    ("stop", [""]), ("stop", [3]),
    ("stop_token_ids", [-1]), ("stop_token_ids", ["a"]),
    ("max_tokens", 0), ("max_tokens", 2.0),
    ("min_tokens", -1),
    ("logprobs", -1), ("prompt_logprobs", -1), ("logprobs", 1.0),
    ("ignore_eos", 1), ("skip_special_tokens", None), ("include_stop_str_in_output", "yes"),
    ("logit_bias", {"x": 1.0}), ("logit_bias", {-3: 1.0}),
    ("timeout_seconds", 0), ("timeout_seconds", -5.0),
    # Values that pass a plain range check but cannot reach the sampler's
    # float32/int64 tensors (each used to fail a whole engine step).
    ("temperature", float("nan")), ("temperature", float("inf")), ("temperature", 1e308), ("temperature", 3.4e38),
    ("top_p", float("nan")), ("min_p", float("nan")), ("presence_penalty", float("nan")),
    ("repetition_penalty", float("inf")), ("repetition_penalty", 1e308),
    ("top_k", 2**63), ("top_k", 2**70), ("n", 2**64), ("n", 1025), ("max_tokens", 2**64), ("min_tokens", 2**63),
    ("logprobs", 2**63), ("prompt_logprobs", 2**70), ("stop_token_ids", [2**64]),
    ("logit_bias", {1: float("nan")}), ("logit_bias", {1: float("inf")}), ("logit_bias", {1: 1e308}),
    ("logit_bias", {2**64: 1.0}), ("timeout_seconds", float("inf")), ("timeout_seconds", float("nan")),
])
def test_invalid_field_names_it(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_error_message_shape():
    with pytest.raises(ValueError, match=r"temperature must be in \[0, 10000\], got -1.0"):
        SamplingParams(temperature=-1.0)


def test_min_tokens_bounded_by_max_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=4)
    assert SamplingParams(min_tokens=5, max_tokens=None).min_tokens == 5


def test_stop_needs_detokenize():
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(stop="x", detokenize=False)


def test_normalisation():
    p = SamplingParams(stop="###", stop_token_ids=(3, 4), top_k=-1, logit_bias={"5": 1})
    assert p.stop == ["###"] and p.stop_token_ids == [3, 4] and p.top_k == 0
    assert p.logit_bias == {5: 1.0}
    assert SamplingParams(top_k=0).top_k == 0 and SamplingParams(top_k=7).top_k == 7


@pytest.mark.parametrize("t", [0, 0.0, 1e-6, 9.9e-6])
def test_tiny_temperature_is_greedy(t):
    p = SamplingParams(temperature=t, top_p=0.5, top_k=3, min_p=0.2)
    assert p.is_greedy and p.temperature == 0.0
    assert (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.0)
    assert not SamplingParams(temperature=1e-4).is_greedy


def test_explicit_fields_and_generation_config():
    p = SamplingParams(temperature=0.3, max_tokens=100)
    assert p.explicit_fields == {"temperature", "max_tokens"}
    gen = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1, "min_p": 0.05,
           "max_new_tokens": 7, "do_sample": True}
    p.update_from_generation_config(gen)
    assert p.temperature == 0.3  # the user's value stays
    assert (p.top_p, p.top_k, p.repetition_penalty, p.min_p) == (0.9, 20, 1.1, 0.05)
    assert p.max_tokens == 100  # max_new_tokens is not mapped
    q = SamplingParams()
    q.update_from_generation_config({"max_new_tokens": 7, "temperature": None})
    assert q.max_tokens == 16 and q.temperature == 1.0
    # an explicit set given by the caller wins over the recorded one
    r = SamplingParams(top_p=0.5)
    r.update_from_generation_config({"top_p": 0.9, "temperature": 0.7}, explicitly_set={"temperature"})
    assert r.top_p == 0.9 and r.temperature == 1.0


def test_generation_config_validated_and_greedy():
    p = SamplingParams(temperature=0.0)
    p.update_from_generation_config({"top_k": 20, "top_p": 0.8})
    assert p.top_k == 0 and p.top_p == 1.0  # still greedy
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams().update_from_generation_config({"top_p": 2.0})


def test_clone_is_deep_and_keeps_explicit():
    p = SamplingParams(stop=["a"], logit_bias={1: 2.0}, seed=3)
    c = p.clone()
    assert c == p and c is not p
    c.stop.append("b")
    c.logit_bias[2] = 1.0
    assert p.stop == ["a"] and p.logit_bias == {1: 2.0}
    assert c.explicit_fields == {"stop", "logit_bias", "seed"}
    assert pickle.loads(pickle.dumps(p)).explicit_fields == p.explicit_fields
    assert copy.copy(p).explicit_fields == p.explicit_fields


def test_verify_vocab():
    SamplingParams(logit_bias={9: 1.0}, stop_token_ids=[9]).verify_vocab(10)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={10: 1.0}).verify_vocab(10)
    with pytest.raises(ValueError, match="stop_token_ids has token ids \\[999999\\] outside the vocabulary"):
        SamplingParams(stop_token_ids=[3, 999999]).verify_vocab(10)


def test_top_k_beyond_the_vocabulary_is_off():
    p = SamplingParams(top_k=10**9)
    p.verify_vocab(10)
    assert p.top_k == 0
    p = SamplingParams(top_k=9)
    p.verify_vocab(10)
    assert p.top_k == 9
