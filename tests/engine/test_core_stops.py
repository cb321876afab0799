"""The engine core's token-level stops (check_stop): EOS and stop token ids
once past min_tokens, ignore_eos, max_tokens, max_model_len."""

from pagoda.core.request import Request
from pagoda.engine.core import check_stop
from pagoda.sampling_params import SamplingParams

EOS = frozenset({2})


def stop_after(outputs, max_model_len=100, **params):
    request = Request("r", [7, 8, 9], SamplingParams(**params))
    for token in outputs:
        request.output_token_ids.append(token)
        reason = check_stop(request, EOS, max_model_len)
        if reason != (None, None):
            return len(request.output_token_ids), reason
    return None


def test_eos_ends_a_sequence_without_a_stop_reason():
    assert stop_after([5, 6, 2, 5]) == (3, ("stop", None))


def test_ignore_eos_runs_to_max_tokens():
    assert stop_after([5, 2, 2, 6], ignore_eos=True, max_tokens=4) == (4, ("length", None))


def test_a_stop_token_id_is_the_stop_reason():
    assert stop_after([5, 6, 11, 5], stop_token_ids=[11]) == (3, ("stop", 11))


def test_min_tokens_delays_stops():
    assert stop_after([2, 11, 5, 11], stop_token_ids=[11], min_tokens=3) == (4, ("stop", 11))


def test_max_tokens_and_max_model_len_end_with_length():
    assert stop_after([5] * 10, max_tokens=3) == (3, ("length", None))
    assert stop_after([5] * 10, max_model_len=8, max_tokens=None) == (5, ("length", None))
