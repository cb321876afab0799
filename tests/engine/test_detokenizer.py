import random

import pytest

from pagoda.engine.detokenizer import IncrementalDetokenizer, find_stop_string, make_logprob_dict, partial_stop_len
from pagoda.model_executor.layers.sampler import TokenLogprobs
from pagoda.sampling_params import SamplingParams

TEXTS = [
    "héllo 世界 🙂",
    "naïve café 🚀🚀 日本語テキスト",
    " 😀😀😀 Ünïcödé wörld",
    "plain ascii text, nothing special.",
]


class SlowWrapper:
    """A tokenizer without a Rust backend: exercises the generic decode path."""

    def __init__(self, hf):
        self.hf = hf

    def decode(self, ids, skip_special_tokens=False, **kwargs):
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def get_added_vocab(self):
        return self.hf.get_added_vocab()


@pytest.fixture(params=["fast", "generic"])
def tokenizer(request, hf_tokenizer):
    return hf_tokenizer if request.param == "fast" else SlowWrapper(hf_tokenizer)


def eos(hf):
    return hf.convert_tokens_to_ids("<eos>")


def stream(detok, ids):
    """Feed one token per step; the streamed chunks."""
    return [detok.append([t]) for t in ids]


def test_split_characters_exist(hf_tokenizer):
    """The fixture is useful only if some tokens end mid-character."""
    ids = hf_tokenizer.encode(TEXTS[0] + TEXTS[1])
    assert any("\ufffd" in hf_tokenizer.decode([t]) for t in ids)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("prompt", ["", "Say: ", "héllo 🙂"])
def test_incremental_equals_full_decode(tokenizer, hf_tokenizer, text, prompt):
    prompt_ids = hf_tokenizer.encode(prompt)
    ids = hf_tokenizer.encode(text)
    d = IncrementalDetokenizer(tokenizer, prompt_ids, SamplingParams(max_tokens=1000))
    shown = ""
    for i, t in enumerate(ids):
        shown += d.append([t])
        full = hf_tokenizer.decode(ids[: i + 1])
        assert "\ufffd" not in shown and d.output_text == shown
        if full.endswith("\ufffd"):
            # a character still being completed: held back with its token
            assert full.startswith(shown)
        else:
            assert shown == full
    assert shown == text and not d.finished


def test_random_valid_sequences_stream_without_replacement_chars(tokenizer, hf_tokenizer):
    rng = random.Random(0)
    alphabet = list("abc xyz,.") + list("éöü世界日本🙂😀🚀")
    for _ in range(30):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
        ids = hf_tokenizer.encode(text)
        d = IncrementalDetokenizer(tokenizer, hf_tokenizer.encode("ctx 世"), SamplingParams(max_tokens=None))
        shown = "".join(stream(d, ids))
        assert "\ufffd" not in shown and shown == text


def test_invalid_bytes_come_out_at_the_end(tokenizer, hf_tokenizer):
    """Tokens that never form a valid character: flushed when the core ends
    the sequence, so the final text equals tokenizer.decode of all tokens."""
    partial = [t for t in hf_tokenizer.encode("🙂🙂") if "\ufffd" in hf_tokenizer.decode([t])][:1]
    assert partial
    seq = hf_tokenizer.encode("ab ") + partial
    d = IncrementalDetokenizer(tokenizer, [], SamplingParams(max_tokens=len(seq)))
    shown = "".join(stream(d, seq[:-1])) + d.append(seq[-1:], finish_reason="length")
    assert d.finish_reason == "length"
    assert shown == d.output_text == hf_tokenizer.decode(seq)


@pytest.mark.parametrize("skip", [True, False])
def test_byte_level_window_shortcut_streams_the_same_chunks(hf_tokenizer, skip):
    """A byte-level tokenizer takes the emitted delta as the window's new
    prefix text instead of decoding it again: on random ids (split characters,
    invalid bytes, special tokens) every chunk equals the generic path's."""
    rng = random.Random(1)
    vocab = len(hf_tokenizer)
    for _ in range(40):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(0, 30))]
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 60))]
        params = SamplingParams(max_tokens=len(ids), skip_special_tokens=skip)
        fast = IncrementalDetokenizer(hf_tokenizer, prompt, params)
        generic = IncrementalDetokenizer(SlowWrapper(hf_tokenizer), prompt, params)
        assert fast.decoder.byte_level and not generic.decoder.byte_level
        assert stream(fast, ids) == stream(generic, ids)
        assert fast.finish("length") == generic.finish("length")
        assert fast.output_text == generic.output_text


def test_skip_special_tokens(tokenizer, hf_tokenizer):
    sep = hf_tokenizer.convert_tokens_to_ids("<sep>")
    ids = hf_tokenizer.encode("héllo") + [sep, sep] + hf_tokenizer.encode(" wörld")
    for skip in (True, False):
        for spaces in (True, False):
            d = IncrementalDetokenizer(tokenizer, [], SamplingParams(skip_special_tokens=skip,
                                                                     spaces_between_special_tokens=spaces))
            assert "".join(stream(d, ids)) == hf_tokenizer.decode(ids, skip_special_tokens=skip)
    assert "<sep><sep>" in hf_tokenizer.decode(ids)


def test_a_stop_token_is_shown_only_on_request(tokenizer, hf_tokenizer):
    """The core ends a sequence at EOS or a stop token id ("stop" with its
    last token): that token's text is shown only with
    include_stop_str_in_output, and later tokens are ignored."""
    ids = hf_tokenizer.encode("hello world")
    stop_id = ids[-1]
    for include in (False, True):
        d = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop_token_ids=[stop_id],
                                                                 include_stop_str_in_output=include))
        out = "".join(stream(d, ids[:-1])) + d.append([stop_id], finish_reason="stop", stop_reason=stop_id)
        assert d.finish_reason == "stop" and d.stop_reason == stop_id and d.output_token_ids == ids
        assert out == (hf_tokenizer.decode(ids) if include else hf_tokenizer.decode(ids[:-1]))
        assert d.append(hf_tokenizer.encode("x")) == "" and d.output_token_ids == ids  # finished: ignored
    e = eos(hf_tokenizer)
    d = IncrementalDetokenizer(tokenizer, [], SamplingParams(skip_special_tokens=False))
    assert d.append(hf_tokenizer.encode("héllo") + [e], finish_reason="stop") == "héllo"
    assert d.finish_reason == "stop" and d.stop_reason is None


def test_the_cores_finish_comes_with_the_last_token(tokenizer, hf_tokenizer):
    """"length" (max_tokens, max_model_len) and the like end the sequence
    after the token they come with, whose text is shown."""
    ids = hf_tokenizer.encode("The quick brown fox")
    d = IncrementalDetokenizer(tokenizer, [], SamplingParams(max_tokens=len(ids)))
    assert "".join(stream(d, ids[:-1])) + d.append(ids[-1:], finish_reason="length") == hf_tokenizer.decode(ids)
    assert d.finish_reason == "length" and d.stop_reason is None and d.output_token_ids == ids


def test_min_tokens_delays_stop_strings(hf_tokenizer):
    d = IncrementalDetokenizer(hf_tokenizer, [], SamplingParams(min_tokens=2, stop=["a"]))
    stream(d, hf_tokenizer.encode("a") * 2)
    assert not d.finished  # the sampler cannot end a sequence before min_tokens either
    d.append(hf_tokenizer.encode("a"))
    assert d.finish_reason == "stop" and d.stop_reason == "a" and len(d.output_token_ids) == 3


def test_stop_string_spanning_tokens(tokenizer, hf_tokenizer):
    text = "héllo wörld, hello world!"
    ids = hf_tokenizer.encode(text)
    stop = "wörld, hel"
    # the stop string is not inside a single token
    assert not any(stop in hf_tokenizer.decode([t]) for t in ids)
    for include in (False, True):
        d = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["zzz", stop], include_stop_str_in_output=include,
                                                                 max_tokens=100))
        chunks = stream(d, ids)
        shown = "".join(chunks)
        want = "héllo " + (stop if include else "")
        assert shown == d.output_text == want
        assert d.finish_reason == "stop" and d.stop_reason == stop
        # tokens after the one completing the stop string are not taken
        assert len(d.output_token_ids) < len(ids)
        if not include:
            # no chunk ever showed a part of the stop string
            assert all("w" not in c for c in chunks)


def test_earliest_stop_string_wins(hf_tokenizer):
    ids = hf_tokenizer.encode("abc STOP here; ### end")
    d = IncrementalDetokenizer(hf_tokenizer, [], SamplingParams(stop=["###", "here", "STOP"], max_tokens=100))
    d.append(ids)  # all at once: several stop strings in new text
    assert d.stop_reason == "STOP" and d.output_text == "abc "


def test_stop_string_held_back_then_released(hf_tokenizer):
    d = IncrementalDetokenizer(hf_tokenizer, [], SamplingParams(stop=["###"], max_tokens=100))
    out = [d.append(hf_tokenizer.encode(s)) for s in ["ab", " #", "#", " c"]]
    assert out == ["ab", " ", "", "## c"]
    assert not d.finished
    assert d.finish("abort") == "" and d.finish_reason == "abort"
    d2 = IncrementalDetokenizer(hf_tokenizer, [], SamplingParams(stop=["###"], max_tokens=100))
    d2.append(hf_tokenizer.encode("x ##"))
    assert d2.visible_text == "x " and d2.finish("timeout") == "##" and d2.finish_reason == "timeout"


def test_stop_helpers():
    assert find_stop_string("abcXYde", 2, ["XY", "de"]) == ("de", 5)  # XY was searched already
    assert find_stop_string("abcXYde", 4, ["de", "XY"]) == ("XY", 3)
    assert find_stop_string("abc", 0, ["abc"]) is None
    assert partial_stop_len("hello ##", ["###", "lo #x"]) == 2
    assert partial_stop_len("hello #", ["o #x"]) == 3
    assert partial_stop_len("hello", ["###"]) == 0


def test_no_tokenizer_or_no_detokenize(hf_tokenizer):
    e = eos(hf_tokenizer)
    d = IncrementalDetokenizer(None, [1, 2], SamplingParams(max_tokens=5))
    assert d.append([5, 6]) == "" and d.append([e], finish_reason="stop") == ""
    assert d.finish_reason == "stop" and d.output_token_ids == [5, 6, e]
    d = IncrementalDetokenizer(hf_tokenizer, [], SamplingParams(detokenize=False, max_tokens=2))
    assert d.append(hf_tokenizer.encode("hello world")[:2], finish_reason="length") == ""
    assert d.finish_reason == "length"


def test_logprobs_tracked_and_cut_with_tokens(hf_tokenizer):
    ids = hf_tokenizer.encode("hello world")
    lps = [TokenLogprobs([t, t, 5], [-0.5, -0.5, -1.0], 1) for t in ids]
    d = IncrementalDetokenizer(hf_tokenizer, [], SamplingParams(logprobs=2, stop=["llo"]))
    d.append(ids, lps)  # the stop string ends it at "llo": later tokens and their logprobs are dropped
    assert d.finish_reason == "stop" and len(d.output_token_ids) == len(d.logprobs) == 2 and d.cumulative_logprob == pytest.approx(-1.0)
    entry = d.logprobs[0]
    assert entry[ids[0]].rank == 1 and entry[5].rank == 2 and entry[5].decoded_token == hf_tokenizer.decode([5])
    lp = make_logprob_dict(TokenLogprobs([9, 1, 2], [-3.0, -0.1, -0.2], 7))
    assert lp[9].rank == 7 and lp[1].rank == 1 and lp[2].logprob == -0.2 and lp[9].decoded_token is None


@pytest.mark.parametrize("kind", ["fast", "generic"])
def test_sentencepiece_style_spacing_and_byte_fallback(sp_tokenizer, kind):
    tok = sp_tokenizer if kind == "fast" else SlowWrapper(sp_tokenizer)
    prompt = sp_tokenizer.encode("hello", add_special_tokens=False)
    out = sp_tokenizer.encode(" world 世界 hello 🙂 wé", add_special_tokens=False)
    assert sp_tokenizer.decode(out[:1]) == "world"  # alone, the token loses its space
    assert sum(t < 259 for t in out) > 8  # byte-fallback pieces present
    d = IncrementalDetokenizer(tok, prompt, SamplingParams(max_tokens=None))
    chunks = stream(d, out)
    assert chunks[0] == " world"
    assert "\ufffd" not in "".join(chunks)
    assert "".join(chunks) == sp_tokenizer.decode(prompt + out)[len(sp_tokenizer.decode(prompt)):]
