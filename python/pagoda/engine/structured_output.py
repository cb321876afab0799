"""Structured outputs with xgrammar (issue 16): the engine core's side.

A request's SamplingParams.structured_outputs (a JSON schema, a regex, a list
of choices, an EBNF grammar, or any JSON object) becomes a grammar compiled
against the model's vocabulary, and a matcher per sequence that knows which
tokens may come next. The split follows vLLM v1's:
- the front end checks the spec (check(): xgrammar parses it without the
  vocabulary, so a bad schema is a ValueError at admission, never a failed
  step);
- the engine core compiles it on a thread pool when the sequence arrives
  (compiled grammars are cached by (kind, spec), so n sequences of one
  request and repeated schemas compile once), and schedules the sequence only
  once its grammar is ready, so a step never waits for a compile;
- after each schedule() the core fills one bitmask row per constrained
  sequence that samples in the step, for the whole batch at once, and ships
  the rows with the scheduler output; the worker applies them to the logits
  on the device (model_executor/layers/sampler.py);
- each sampled token advances its sequence's matcher; a matcher that
  terminates ends its sequence ("stop").

A constrained sequence's next mask needs the token it sampled last, so
constrained sequences make the core read each step's ids before it schedules
the next one, as penalties do (engine/core.py).

xgrammar (and with it torch) is imported only when the first structured
request arrives; this module's own code handles no tensors (the bitmask is
numpy, filled by xgrammar).
"""

from __future__ import annotations

import collections
import json
import re
import threading
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any, Callable

from pagoda.logger import init_logger
from pagoda.sampling_params import StructuredOutputsParams

logger = init_logger(__name__)

# Compiles at once: each uses xgrammar's own threads too.
COMPILE_THREADS = 2
# Compiled grammars (and checked specs) kept for reuse, most recent first.
CACHE_SIZE = 256

# xgrammar prefixes its messages with a time and its C++ source location.
_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


def _message(exc: BaseException) -> str:
    return _XGRAMMAR_PREFIX.sub("", str(exc)).strip()


def _xgrammar():
    import xgrammar

    return xgrammar


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly the given strings (JSON
    string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def _parse(key: tuple[str, str], any_whitespace: bool):
    """The spec as an xgrammar Grammar (no vocabulary needed); RuntimeError
    from xgrammar when it cannot be turned into one."""
    xgr = _xgrammar()
    kind, spec = key
    if kind == "json":
        return _json_strings_without_controls(xgr.Grammar.from_json_schema(spec, any_whitespace=any_whitespace))
    if kind == "json_object":  # an object, as OpenAI's json_object promises (xgrammar's builtin allows arrays)
        return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=any_whitespace)
    if kind == "regex":
        return xgr.Grammar.from_regex(spec)
    if kind == "grammar":
        return xgr.Grammar.from_ebnf(spec)
    return xgr.Grammar.from_ebnf(choice_grammar(json.loads(spec)))


# xgrammar 0.2.8 writes a string with minLength/maxLength as {m, n} of this
# class, which lets raw control characters (a tab) into the string: not JSON.
_LENGTH_CHARACTER = '::= (([^\\"\\\\\\r\\n]))'
_JSON_STRING_CHARACTER = '::= (([^\\0-\\x1f\\"\\\\]))'


def _json_strings_without_controls(grammar):
    """The grammar with its length-bounded string characters limited to what
    JSON allows unescaped (an unchanged grammar where there are none)."""
    text = str(grammar)
    if _LENGTH_CHARACTER not in text:
        return grammar
    return _xgrammar().Grammar.from_ebnf(text.replace(_LENGTH_CHARACTER, _JSON_STRING_CHARACTER))


class _LRU(collections.OrderedDict):
    def remember(self, key, value) -> None:
        self[key] = value
        self.move_to_end(key)
        while len(self) > CACHE_SIZE:
            self.popitem(last=False)


_checked = _LRU()  # (key, any_whitespace) -> error message or None
_checked_lock = threading.Lock()


def check(params: StructuredOutputsParams) -> None:
    """ValueError naming the problem when xgrammar cannot turn the spec
    into a grammar (an unsupported schema keyword, a bad regex, an EBNF
    syntax error). Cached: a repeated spec costs a dict lookup."""
    cache_key = (params.key, not params.disable_any_whitespace)
    with _checked_lock:
        known = cache_key in _checked
        error = _checked.get(cache_key)
    if not known:
        try:
            _parse(*cache_key)
            error = None
        except RuntimeError as exc:
            error = _message(exc)
        with _checked_lock:
            _checked.remember(cache_key, error)
    if error is not None:
        kind = params.key[0]
        what = {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regex",
                "grammar": "grammar", "choice": "choice"}[kind]
        raise ValueError(f"structured_outputs.{kind}: the {what} cannot be compiled: {error}")


class StructuredOutputManager:
    """The core's grammars: compiles on a thread pool, one matcher per
    constrained sequence, the batch's bitmask each step."""

    def __init__(self, vocab_size: int, eos_token_ids: list[int], load_tokenizer: Callable[[], Any]):
        self.vocab_size = vocab_size  # the model's (its logits' width): may exceed the tokenizer's
        self.eos_token_ids = list(eos_token_ids)
        self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="pagoda-grammar")
        self._compiler: Future = self._pool.submit(self._make_compiler, load_tokenizer)
        self._compiled = _LRU()  # (key, any_whitespace) -> Future[CompiledGrammar]
        self._pending: dict[str, Future] = {}  # sequence id -> its grammar, compiling
        self._matchers: dict[str, Any] = {}  # sequence id -> GrammarMatcher, once compiled
        self._batch = None  # xgrammar's BatchGrammarMatcher: fills rows on its threads

    def _make_compiler(self, load_tokenizer):
        xgr = _xgrammar()
        info = xgr.TokenizerInfo.from_huggingface(load_tokenizer(), vocab_size=self.vocab_size,
                                                  stop_token_ids=self.eos_token_ids)
        return xgr.GrammarCompiler(info)

    def _compile(self, key: tuple[str, str], any_whitespace: bool):
        compiler = self._compiler.result()
        return compiler.compile_grammar(_parse(key, any_whitespace))

    # --- sequences --------------------------------------------------------

    def add(self, request_id: str, params: StructuredOutputsParams) -> None:
        """Starts compiling a sequence's grammar (or shares one compiled or compiling)."""
        cache_key = (params.key, not params.disable_any_whitespace)
        future = self._compiled.get(cache_key)
        if future is None or (future.done() and future.exception() is not None):
            future = self._pool.submit(self._compile, *cache_key)
        self._compiled.remember(cache_key, future)
        self._pending[request_id] = future

    def pending(self) -> list[str]:
        return list(self._pending)

    def wait_any(self, timeout: float) -> None:
        """Waits up to `timeout` seconds for a pending grammar (an idle core
        would otherwise spin)."""
        wait(list(self._pending.values()), timeout=timeout, return_when=FIRST_COMPLETED)

    def take_ready(self) -> tuple[list[str], dict[str, str]]:
        """Sequences whose grammar compiled since the last call (their
        matchers made), and those whose compile failed, with why."""
        ready, failed = [], {}
        for request_id, future in list(self._pending.items()):
            if not future.done():
                continue
            del self._pending[request_id]
            exc = future.exception()
            if exc is not None:
                failed[request_id] = f"structured_outputs: the grammar cannot be compiled: {_message(exc)}"
                continue
            self._matchers[request_id] = _xgrammar().GrammarMatcher(future.result())
            ready.append(request_id)
        return ready, failed

    def remove(self, request_id: str) -> None:
        self._pending.pop(request_id, None)
        self._matchers.pop(request_id, None)

    # --- steps ------------------------------------------------------------

    def bitmask(self, sampling_ids: list[str]):
        """(ids, rows) for the constrained ones among a step's sampling
        sequences: rows is an int32 numpy array [len(ids), ceil(vocab / 32)],
        bit j of a row set where token j may come next; None when none is
        constrained."""
        ids = [r for r in sampling_ids if r in self._matchers]
        if not ids:
            return None
        import numpy as np

        xgr = _xgrammar()
        rows = np.empty(xgr.get_bitmask_shape(len(ids), self.vocab_size), dtype=np.int32)
        if self._batch is None:
            self._batch = xgr.BatchGrammarMatcher()
        self._batch.batch_fill_next_token_bitmask([self._matchers[r] for r in ids], rows)
        return ids, rows

    def accept(self, request_id: str, token: int) -> tuple[bool, bool]:
        """Advances a constrained sequence's matcher by its new token:
        (whether the grammar allowed it, whether the matcher terminated).
        (True, False) for a sequence without a grammar."""
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return True, False
        if not matcher.accept_token(token):
            return False, False
        return True, matcher.is_terminated()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
