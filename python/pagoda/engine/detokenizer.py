"""Per-completion output handling in the front end: incremental
detokenization, stop strings and sample logprobs.

One `IncrementalDetokenizer` per completion; the output processor calls
`append(new_token_ids, new_logprobs, finish_reason)` with what the engine core
sent each step and streams what it returns.
"""

from __future__ import annotations

from typing import Callable, Sequence

from pagoda.outputs import Logprob, PromptLogprobs
from pagoda.sampling_params import SamplingParams

_REPLACEMENT = "\ufffd"  # what decode gives for an incomplete UTF-8 sequence
_PRIME_MIN, _PRIME_MAX = 4, 24  # prompt tokens used as left context (vLLM's numbers)


def _decode_fn(tokenizer, skip_special_tokens: bool, spaces_between_special_tokens: bool) -> Callable[[list[int]], str]:
    """ids -> text. For fast tokenizers, the Rust tokenizer directly (no Python
    wrapper per step); its decode, like transformers' fast decode, ignores
    spaces_between_special_tokens (see _Decoder.step for how we honour it)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None and hasattr(tokenizer, "decode_batch"):  # a bare tokenizers.Tokenizer
        backend = tokenizer
    if backend is not None:
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens,
                                        spaces_between_special_tokens=spaces_between_special_tokens)


def _is_byte_level(tokenizer) -> bool:
    """Whether the tokenizer's decoder is byte-level BPE's (GPT-2, Llama 3,
    Qwen): each token decodes to its own bytes whatever surrounds it."""
    from tokenizers.decoders import ByteLevel

    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    return isinstance(getattr(backend, "decoder", None), ByteLevel)


def _added_tokens(tokenizer) -> dict[int, str]:
    get = getattr(tokenizer, "get_added_vocab", None)
    return {i: t for t, i in get().items()} if get else {}


class _Decoder:
    """Incremental decode with vLLM's prefix/read offsets: decode a small window
    of recent tokens and emit what it adds beyond the window's already-emitted
    part. Decoding a window (not a lone token) keeps context-dependent spacing
    right (e.g. SentencePiece's leading space), and text that ends in U+FFFD
    (a character cut mid-bytes) waits for the token that completes it."""

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], params: SamplingParams):
        self.decode = _decode_fn(tokenizer, params.skip_special_tokens, params.spaces_between_special_tokens)
        # Prime with the shortest prompt suffix (>= 4 tokens) that decodes
        # cleanly, so the first output token is decoded in context.
        prompt = list(prompt_token_ids)
        self.ids = prompt[-_PRIME_MIN:]
        for n in range(_PRIME_MIN, min(len(prompt), _PRIME_MAX) + 1):
            if _REPLACEMENT not in self.decode(prompt[-n:]):
                self.ids = prompt[-n:]
                break
        self.read_offset = len(self.ids)  # ids[:read_offset] are already emitted (window starts at 0)
        self.prefix_text = self.decode(self.ids)
        self.byte_level = _is_byte_level(tokenizer)
        # spaces_between_special_tokens=False: two added tokens in a row are
        # joined without whatever separator the decoder would put (vLLM's rule).
        self.added = {} if params.skip_special_tokens or params.spaces_between_special_tokens else _added_tokens(tokenizer)
        self.last_added = False

    def step(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self.decode(self.ids)
        if len(text) <= len(self.prefix_text) or text.endswith(_REPLACEMENT):
            delta = ""
        else:
            delta = text[len(self.prefix_text):]
            # Slide the window: the tokens just emitted become its prefix.
            self.ids = self.ids[self.read_offset:]
            self.read_offset = len(self.ids)
            # Byte-level tokens decode to their own bytes, so after a prefix
            # of valid UTF-8 the new tokens' text is exactly the delta: one
            # decode per token instead of two.
            shortcut = self.byte_level and _REPLACEMENT not in self.prefix_text
            self.prefix_text = delta if shortcut else self.decode(self.ids)
        if self.added:
            is_added = token_id in self.added
            if is_added and self.last_added:
                delta = self.added[token_id]
            self.last_added = is_added
        return delta

    def flush(self) -> str:
        """At the end: whatever is still held back (an incomplete character
        decodes to U+FFFD, as tokenizer.decode would give it)."""
        if self.read_offset == len(self.ids):
            return ""
        text = self.decode(self.ids)
        self.ids, self.read_offset = [], 0
        return text[len(self.prefix_text):]


def find_stop_string(text: str, num_new_chars: int, stop: Sequence[str]) -> tuple[str, int] | None:
    """The earliest stop string that ends within the last num_new_chars chars
    of text, as (stop string, start index); earlier text was searched before."""
    best = None
    for s in stop:
        i = text.find(s, max(0, len(text) - num_new_chars - len(s) + 1))
        if i != -1 and (best is None or i < best[1]):
            best = (s, i)
    return best


def partial_stop_len(text: str, stop: Sequence[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of a stop
    string: those chars are held back from streaming until resolved."""
    hold = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:n]):
                hold = n
                break
    return hold


class IncrementalDetokenizer:
    """Output text, token ids, logprobs and finish state of one completion,
    from the token ids the engine core sends. The core decides token-level
    stops (EOS, stop token ids, max_tokens, ...) and says so with the token
    that ends the sequence; stop strings are found here, in the text.

    tokenizer may be None (or params.detokenize False): then no text and no
    stop strings, only ids and finish reasons."""

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], params: SamplingParams):
        self.tokenizer = tokenizer
        self.params = params
        self.decoder = _Decoder(tokenizer, prompt_token_ids, params) if tokenizer is not None and params.detokenize else None
        self.output_token_ids: list[int] = []
        self.output_text = ""  # everything decoded, cut at a stop string
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self._streamed = 0  # chars of output_text already returned by append/finish
        # A held-back partial stop string only matters when it would be cut.
        self._stop_for_holdback = [] if params.include_stop_str_in_output else params.stop

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def visible_text(self) -> str:
        """The text a stream has shown so far (all of it once finished)."""
        return self.output_text[: self._streamed]

    @property
    def num_visible_chars(self) -> int:
        return self._streamed

    def append(self, token_ids: Sequence[int], logprobs: Sequence | None = None, finish_reason: str | None = None,
               stop_reason: int | None = None) -> str:
        """Add a step's new tokens from the core (usually one), their
        TokenLogprobs (or None), and how the core ended the sequence with the
        last of them, if it did: "stop" means the last token is EOS or the
        stop token id `stop_reason`, whose text is shown only with
        include_stop_str_in_output. Returns the new text safe to stream.
        Tokens after a stop string are dropped."""
        last = len(token_ids) - 1
        for i, tid in enumerate(token_ids):
            if self.finished:
                break
            self._append_one(tid, None if logprobs is None else logprobs[i], i == last and finish_reason == "stop")
        if finish_reason is not None and not self.finished:
            self.finish_reason, self.stop_reason = finish_reason, stop_reason
            self._flush()
        return self._take_delta()

    def finish(self, reason: str, stop_reason: int | str | None = None) -> str:
        """End it from outside (abort, timeout, an error).
        Returns the remaining text to stream. No-op once finished."""
        if not self.finished:
            self.finish_reason, self.stop_reason = reason, stop_reason
            self._flush()
        return self._take_delta()

    def _append_one(self, tid: int, token_logprobs, is_stop_token: bool) -> None:
        params = self.params
        self.output_token_ids.append(tid)
        if self.logprobs is not None and token_logprobs is not None:
            self.logprobs.append(make_logprob_dict(token_logprobs, self.tokenizer))
            self.cumulative_logprob += token_logprobs.logprobs[0]
        if is_stop_token:
            # The stop token's own text is shown only on request (vLLM).
            if params.include_stop_str_in_output:
                self._add_text(tid)
            return
        new_chars = self._add_text(tid)
        if params.stop and new_chars and len(self.output_token_ids) > params.min_tokens:
            hit = find_stop_string(self.output_text, new_chars, params.stop)
            if hit is not None:
                s, start = hit
                self.output_text = self.output_text[: start + len(s) if params.include_stop_str_in_output else start]
                self.finish_reason, self.stop_reason = "stop", s
                # Text after a stop string is cut, so nothing to flush.

    def _add_text(self, tid: int) -> int:
        if self.decoder is None:
            return 0
        delta = self.decoder.step(tid)
        self.output_text += delta
        return len(delta)

    def _flush(self) -> None:
        if self.decoder is not None:
            self.output_text += self.decoder.flush()

    def _take_delta(self) -> str:
        end = len(self.output_text)
        if not self.finished and self._stop_for_holdback:
            end -= partial_stop_len(self.output_text, self._stop_for_holdback)
        if end <= self._streamed:
            return ""
        delta, self._streamed = self.output_text[self._streamed:end], end
        return delta


def _decode_tokens(tokenizer, token_ids: Sequence[int]) -> list[str | None]:
    """Each token alone, as vLLM shows it in logprobs (bytes of a split
    character come out as U+FFFD)."""
    if tokenizer is None:
        return [None] * len(token_ids)
    return [tokenizer.decode([t]) for t in token_ids]


def make_logprob_dict(token_logprobs, tokenizer=None) -> dict[int, Logprob]:
    """A sampler TokenLogprobs -> {token id: Logprob}: the chosen token with its
    rank, then the top-k with ranks 1..k."""
    ids, vals = token_logprobs.token_ids, token_logprobs.logprobs
    texts = _decode_tokens(tokenizer, ids)
    out = {ids[0]: Logprob(vals[0], token_logprobs.rank, texts[0])}
    for r, (t, v, s) in enumerate(zip(ids[1:], vals[1:], texts[1:]), start=1):
        out[t] = Logprob(v, r, s)
    return out


def make_prompt_logprobs(token_logprobs: Sequence, tokenizer=None) -> PromptLogprobs:
    """compute_prompt_logprobs' result -> vLLM's list, None first (nothing
    predicts the first prompt token)."""
    return [None] + [make_logprob_dict(t, tokenizer) for t in token_logprobs]
