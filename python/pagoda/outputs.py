"""What the engine hands back to callers, with vLLM's class and attribute names
so code written against vLLM's outputs reads ours unchanged."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import msgspec

# Why a completion ended: "stop" (EOS, a stop token id or a stop string),
# "length" (max_tokens or the model's context), "abort" (the caller),
# "timeout" (SamplingParams.timeout_seconds passed), "error" (the request
# failed inside the engine: RequestOutput.error says why), None while running.
FINISH_REASONS = ("stop", "length", "abort", "timeout", "error")


class RequestOutputKind(enum.Enum):
    """vLLM's output kinds: what each RequestOutput of a request holds."""

    CUMULATIVE = 0  # everything generated so far
    DELTA = 1  # only the text, token ids and logprobs new since the previous output
    FINAL_ONLY = 2  # one output, when the request finishes


@dataclass
class Logprob:
    """One candidate token's log-probability; rank 1 is the most likely token."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class TokenLogprobs(msgspec.Struct, array_like=True, gc=False):
    """Raw logprobs at one position, as the sampler computes them and the
    engine core sends them: token_ids[0]/logprobs[0] is the chosen (or
    prompt) token with its rank; then the top-k tokens, most likely first
    (their ranks are 1..k). The front end turns them into Logprob dicts."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int


# Per position: token id -> Logprob, holding the chosen token and the top-k.
SampleLogprobs = list[dict[int, Logprob]]
# Per prompt position; the first is None (nothing predicts the first token).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None

    def __repr__(self) -> str:
        return (f"CompletionOutput(index={self.index}, text={self.text!r}, token_ids={_short(self.token_ids)}, "
                f"cumulative_logprob={self.cumulative_logprob}, "
                f"logprobs={'None' if self.logprobs is None else f'<{len(self.logprobs)} positions>'}, "
                f"finish_reason={self.finish_reason}, stop_reason={self.stop_reason!r})")


@dataclass
class RequestMetrics:
    """Wall-clock times (time.time()) of a request's milestones; None until reached."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    def timings(self) -> dict[str, float]:
        """Seconds in each phase of a finished request: queue_s (arrival to
        first scheduled), prefill_s (to the first token), decode_s (first to
        last token), total_s (arrival to finish). A phase never reached (an
        abort while waiting) counts 0."""
        end = self.finished_time if self.finished_time is not None else self.last_token_time or self.arrival_time
        scheduled = self.first_scheduled_time if self.first_scheduled_time is not None else end
        first = self.first_token_time if self.first_token_time is not None else end
        last = self.last_token_time if self.last_token_time is not None else first
        return dict(queue_s=scheduled - self.arrival_time, prefill_s=max(first - scheduled, 0.0),
                    decode_s=max(last - first, 0.0), total_s=end - self.arrival_time)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int | None = field(default=None)  # prompt tokens served from the prefix cache
    # Why the request failed inside the engine (finished, finish_reason
    # "error"); None for every other request. The engine served on.
    error: str | None = None

    def __repr__(self) -> str:
        return (f"RequestOutput(request_id={self.request_id!r}, prompt={self.prompt!r}, "
                f"prompt_token_ids={_short(self.prompt_token_ids)}, "
                f"prompt_logprobs={'None' if self.prompt_logprobs is None else f'<{len(self.prompt_logprobs)} positions>'}, "
                f"outputs={self.outputs!r}, finished={self.finished}, metrics={self.metrics!r})")


def _short(ids: list[int], keep: int = 8) -> str:
    """Long token lists shortened in reprs: logs stay readable."""
    if len(ids) <= 2 * keep:
        return repr(list(ids))
    head = ", ".join(map(str, ids[:keep]))
    tail = ", ".join(map(str, ids[-keep:]))
    return f"[{head}, ... ({len(ids) - 2 * keep} more), {tail}]"


@dataclass
class ModelRunnerOutput:
    """What a worker returns for a step, in plain lists: the sampled token of
    each row that sampled (and its logprobs when asked), prompt logprobs
    computed this step, and the requests whose own work in the step failed
    (id -> why): they end with finish_reason "error", the step goes on."""

    req_ids: list[str]  # the rows that sampled, in order
    sampled_token_ids: list[int]
    logprobs: list[TokenLogprobs | None] | None = None  # per row; None when no row asked
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)  # entries new this step
    failed: dict[str, str] = field(default_factory=dict)
