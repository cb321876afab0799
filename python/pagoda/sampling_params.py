"""Per-request sampling parameters, with vLLM's names and defaults.

Values are checked when the object is built; a bad value is a ValueError that
names the field. The object remembers which fields the caller passed
(`explicit_fields`) so the engine can fill the others from a model's
generation_config.json without overriding what the user asked for.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, fields
from typing import Any

# Temperatures below this are greedy (as in vLLM): dividing logits by them
# only amplifies float noise, and argmax is what the user means.
SAMPLING_EPS = 1e-5

# generation_config.json keys the engine may use as per-model defaults. vLLM's
# list, minus max_new_tokens: a model's generation length is not an API default.
GENERATION_CONFIG_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")

# Bounds on values that reach the sampler's tensors. Beyond them a value means
# nothing more (every token is equally likely well before temperature 1e4), but
# it can overflow float32/int64 on the way to the device and fail the step.
MAX_TEMPERATURE = 1e4
MAX_REPETITION_PENALTY = 1e4
MAX_LOGIT_BIAS = 1e4
MAX_INT = 2**63 - 1  # counts and lengths live in int64 tensors
# Each of a request's n samples is a sequence in the engine: one request must
# not be able to fill the host's memory with them.
MAX_N = 1024
MAX_TIMEOUT_SECONDS = 1e9


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    """A finite int or float (NaN and infinities are refused everywhere)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _as_list(value, name: str) -> list:
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be a list, got {value!r}")
    return list(value)


def _is_count(x, low: int) -> bool:
    return _is_int(x) and low <= x <= MAX_INT


# What a structured output may be constrained by, in StructuredOutputsParams'
# field order: exactly one is set.
STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(kw_only=True)
class StructuredOutputsParams:
    """A constraint on the generated text (vLLM's name and fields), enforced
    with a grammar: a JSON schema (a dict, or its JSON text), a regular
    expression, one string of a list, an EBNF/GBNF grammar (root rule
    `root`), or any JSON object."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # JSON without whitespace between tokens (vLLM's option): models trained
    # on compact JSON, and bounded lengths whatever the weights.
    disable_any_whitespace: bool = False

    def __post_init__(self):
        if isinstance(self.choice, tuple):
            self.choice = list(self.choice)
        self._verify()

    def _verify(self) -> None:
        given = [name for name in STRUCTURED_OUTPUT_KINDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs needs exactly one of {', '.join(STRUCTURED_OUTPUT_KINDS)}, "
                             f"got {', '.join(given) or 'none'}")
        if isinstance(self.json, str):
            try:
                json.loads(self.json)
            except ValueError as exc:
                raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
        elif self.json is not None and not isinstance(self.json, dict):
            raise ValueError(f"structured_outputs.json must be a JSON schema (a dict or its JSON text), "
                             f"got {type(self.json).__name__}")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, str) and v):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {v!r}")
        if self.choice is not None and not (isinstance(self.choice, list) and self.choice
                                            and all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty strings, "
                             f"got {self.choice!r}")
        for name in ("json_object", "disable_any_whitespace"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, bool):
                raise ValueError(f"structured_outputs.{name} must be a bool, got {v!r}")

    @property
    def key(self) -> tuple[str, str]:
        """(kind, spec as text): what a compiled grammar is cached by."""
        kind = next(k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False))
        value = getattr(self, kind)
        if kind == "json_object":
            return kind, ""
        return kind, value if isinstance(value, str) else json.dumps(value)


@dataclass(kw_only=True)
class SamplingParams:
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off (both vLLM conventions; -1 is stored as 0)
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    timeout_seconds: float | None = None  # per-request deadline, from arrival
    structured_outputs: StructuredOutputsParams | None = None  # the output follows a grammar

    # Records the keyword arguments the caller passed. __new__ sees the same
    # arguments as the generated __init__, and copy/pickle restore the set
    # from __dict__, so clones keep it. A copy decoded from the engine core's
    # channel (msgspec builds it without __new__) has none: its defaults
    # were applied before it was sent.
    _explicit = frozenset()

    def __new__(cls, **kwargs):
        self = super().__new__(cls)
        self._explicit = frozenset(kwargs)
        return self

    def __post_init__(self):
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = _as_list(self.stop, "stop")
        self.stop_token_ids = [] if self.stop_token_ids is None else _as_list(self.stop_token_ids, "stop_token_ids")
        if self.logit_bias is not None:
            # JSON clients send token ids as strings; keys become ints here.
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError, AttributeError):
                raise ValueError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}") from None
        if self.top_k == -1:
            self.top_k = 0
        self._verify()
        if self.temperature < SAMPLING_EPS:
            # Greedy: the other sampling knobs cannot change the argmax.
            self.temperature = 0.0
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    def _verify(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(msg)

        need(_is_int(self.n) and 1 <= self.n <= MAX_N, f"n must be in [1, {MAX_N}], got {self.n!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            need(_is_number(v) and -2.0 <= v <= 2.0, f"{name} must be in [-2, 2], got {v!r}")
        need(_is_number(self.repetition_penalty) and 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY,
             f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}], got {self.repetition_penalty!r}")
        need(_is_number(self.temperature) and 0 <= self.temperature <= MAX_TEMPERATURE,
             f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature!r}")
        need(_is_number(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}")
        need(_is_count(self.top_k, 0),
             f"top_k must be 0 or -1 (disable), or at least 1, got {self.top_k!r}")
        need(_is_number(self.min_p) and 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p!r}")
        need(self.seed is None or (_is_int(self.seed) and -(2**63) <= self.seed < 2**64),
             f"seed must be None or an int in [-2**63, 2**64), got {self.seed!r}")
        need(all(isinstance(s, str) and s for s in self.stop), f"stop must be non-empty strings, got {self.stop!r}")
        need(all(_is_count(t, 0) for t in self.stop_token_ids),
             f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}")
        need(self.max_tokens is None or _is_count(self.max_tokens, 1),
             f"max_tokens must be at least 1, got {self.max_tokens!r}")
        need(_is_count(self.min_tokens, 0), f"min_tokens must be non-negative, got {self.min_tokens!r}")
        need(self.max_tokens is None or self.min_tokens <= self.max_tokens,
             f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            need(v is None or _is_count(v, 0), f"{name} must be non-negative, got {v!r}")
        for name in ("ignore_eos", "detokenize", "skip_special_tokens", "spaces_between_special_tokens",
                     "include_stop_str_in_output"):
            v = getattr(self, name)
            need(isinstance(v, bool), f"{name} must be a bool, got {v!r}")
        need(self.detokenize or not self.stop, "stop strings are only supported when detokenize is True")
        if self.logit_bias is not None:
            need(all(0 <= k <= MAX_INT for k in self.logit_bias),
                 f"logit_bias token ids must be non-negative, got {list(self.logit_bias)[:5]!r}")
            need(all(_is_number(v) and abs(v) <= MAX_LOGIT_BIAS for v in self.logit_bias.values()),
                 f"logit_bias values must be finite numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                 f"got {list(self.logit_bias.values())[:5]!r}")
        need(self.timeout_seconds is None
             or (_is_number(self.timeout_seconds) and 0 < self.timeout_seconds <= MAX_TIMEOUT_SECONDS),
             f"timeout_seconds must be in (0, {MAX_TIMEOUT_SECONDS:g}], got {self.timeout_seconds!r}")
        need(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
             f"structured_outputs must be a StructuredOutputsParams, got {type(self.structured_outputs).__name__}")

    @property
    def explicit_fields(self) -> frozenset[str]:
        """The fields the caller set when building this object."""
        return self._explicit

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        """Its sampling depends on the ids generated so far, not just their count."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def update_from_generation_config(self, generation_config: dict, explicitly_set: set[str] | None = None) -> None:
        """Take the model's defaults (generation_config.json) for the sampling
        fields in GENERATION_CONFIG_FIELDS that the user did not set.
        `explicitly_set` defaults to the fields given to the constructor."""
        explicit = self._explicit if explicitly_set is None else explicitly_set
        changed = False
        for name in GENERATION_CONFIG_FIELDS:
            if name not in explicit and generation_config.get(name) is not None:
                setattr(self, name, generation_config[name])
                changed = True
        if changed:
            self.__post_init__()

    def verify_vocab(self, vocab_size: int) -> None:
        """Checks the token ids the sampler indexes with against the model's
        vocabulary, and clamps top_k to it (vLLM's rule: a top_k of the
        vocabulary's size or more keeps every token, so it is off)."""
        for name, ids in (("logit_bias", self.logit_bias or ()), ("stop_token_ids", self.stop_token_ids)):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise ValueError(f"{name} has token ids {bad[:5]} outside the vocabulary (size {vocab_size})")
        if self.top_k >= vocab_size:
            self.top_k = 0

    def clone(self) -> SamplingParams:
        """A copy that shares nothing mutable with this one (a shallow copy
        and new containers: deepcopy costs more than a request's other checks)."""
        other = copy.copy(self)
        other.stop, other.stop_token_ids = list(self.stop), list(self.stop_token_ids)
        if self.logit_bias is not None:
            other.logit_bias = dict(self.logit_bias)
        return other


# Defaults by name, e.g. for the OpenAI server's request models.
DEFAULTS = {f.name: f.default for f in fields(SamplingParams)}
