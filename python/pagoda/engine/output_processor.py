"""From the engine core's token ids to what callers see, in the front end:
per completion an incremental detokenizer (text, stop strings, logprobs),
per request the n completions gathered into one RequestOutput of the kind
the caller asked for (cumulative, delta or final only). Deltas are made at
the source -- only what is new is copied -- so a stream costs O(1) per token,
not a copy of everything so far.

A request that fails here (detokenization) fails alone, as one that fails
inside the core does: finish_reason "error" on every completion, the reason
in RequestOutput.error, and its sequences aborted in the core."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

from pagoda.engine.core_messages import EngineCoreOutput
from pagoda.engine.detokenizer import IncrementalDetokenizer, make_prompt_logprobs
from pagoda.logger import init_logger
from pagoda.outputs import CompletionOutput, PromptLogprobs, RequestMetrics, RequestOutput, RequestOutputKind
from pagoda.sampling_params import SamplingParams

logger = init_logger(__name__)


@dataclass
class Completion:
    """One of a request's n samples: a core sequence id and its text state,
    with how much of it the caller has been sent (for deltas)."""

    index: int
    child_id: str
    detokenizer: IncrementalDetokenizer
    sent_tokens: int = 0
    sent_chars: int = 0

    def output(self, delta: bool) -> CompletionOutput:
        d = self.detokenizer
        if not delta:
            return CompletionOutput(
                index=self.index,
                text=d.visible_text,  # never a held-back partial stop string: streamed text only grows
                token_ids=list(d.output_token_ids),
                cumulative_logprob=d.cumulative_logprob,
                logprobs=None if d.logprobs is None else list(d.logprobs),
                finish_reason=d.finish_reason,
                stop_reason=d.stop_reason,
            )
        start_tokens, start_chars = self.sent_tokens, self.sent_chars
        self.sent_tokens, self.sent_chars = len(d.output_token_ids), d.num_visible_chars
        return CompletionOutput(
            index=self.index,
            text=d.output_text[start_chars : self.sent_chars],
            token_ids=d.output_token_ids[start_tokens:],
            cumulative_logprob=d.cumulative_logprob,
            logprobs=None if d.logprobs is None else d.logprobs[start_tokens:],
            finish_reason=d.finish_reason,
            stop_reason=d.stop_reason,
        )


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    completions: list[Completion]
    metrics: RequestMetrics
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int | None = None  # from the first sequence scheduled
    error: str | None = None  # why it failed inside the engine (RequestOutput.error)
    num_generated_tokens: int = 0  # by all n completions

    @property
    def finished(self) -> bool:
        completions = self.completions
        if len(completions) == 1:  # the common case, checked per request per step
            return completions[0].detokenizer.finish_reason is not None
        return all(c.detokenizer.finished for c in completions)

    def output(self) -> RequestOutput:
        finished = self.finished
        if finished and self.metrics.finished_time is None:
            self.metrics.finished_time = time.time()
        delta = self.output_kind is RequestOutputKind.DELTA
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=self.prompt_logprobs,
            outputs=[c.output(delta) for c in self.completions],
            finished=finished,
            metrics=self.metrics,
            num_cached_tokens=self.num_cached_tokens or 0,
            error=self.error,
        )


@dataclass
class FinishedRequestStats:
    finish_reason: str  # the least successful of its completions' reasons
    num_prompt_tokens: int
    num_generation_tokens: int  # all n completions
    max_completion_tokens: int  # the longest completion
    metrics: RequestMetrics


@dataclass
class IterationStats:
    """What one batch of core outputs (or aborts) did, for the metrics."""

    num_generation_tokens: int = 0
    num_prompt_tokens: int = 0  # prompts of requests that got their first token
    time_to_first_tokens: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)


# A request with completions ending differently (n > 1) counts under the
# least successful reason.
REASON_ORDER = ("error", "abort", "timeout", "length", "stop")


@dataclass
class OutputProcessorResult:
    request_outputs: list[RequestOutput]
    reqs_to_abort: list[str]  # core sequences the front end ended (stop strings, failures)
    stats: IterationStats


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}
        self.parents: dict[str, RequestState] = {}  # live core sequence id -> its request
        # A test hook: called as fault_hook("output", [sequence id]) before a
        # sequence's tokens are detokenized; what it raises fails the request.
        self.fault_hook: Callable[[str, list[str]], None] | None = None

    def has_unfinished_requests(self) -> bool:
        return bool(self.states)

    def add_request(self, state: RequestState) -> None:
        if state.request_id in self.states:
            raise ValueError(f"request_id {state.request_id!r} is already in use")
        self.states[state.request_id] = state
        for completion in state.completions:
            self.parents[completion.child_id] = state

    def process_outputs(self, core_outputs: Iterable[EngineCoreOutput]) -> OutputProcessorResult:
        now = time.time()
        touched: dict[str, RequestState] = {}
        result = OutputProcessorResult([], [], IterationStats())
        for out in core_outputs:
            state = self.parents.get(out.request_id)
            if state is None:
                continue  # ended here already (a stop string, an abort): a token the core had in flight
            touched[state.request_id] = state
            if out.scheduled_time is not None and state.metrics.first_scheduled_time is None:
                state.metrics.first_scheduled_time = out.scheduled_time
            if out.num_cached_tokens is not None and state.num_cached_tokens is None:
                state.num_cached_tokens = out.num_cached_tokens
            if out.error is not None:
                self._fail(state, out.error, result)
                continue
            completion = state.completions[0] if len(state.completions) == 1 else self._completion(state, out)
            try:
                if self.fault_hook is not None:
                    self.fault_hook("output", [out.request_id])
                if out.prompt_logprobs is not None:
                    state.prompt_logprobs = make_prompt_logprobs(out.prompt_logprobs, self.tokenizer)
                num_before = len(completion.detokenizer.output_token_ids)
                completion.detokenizer.append(out.new_token_ids, out.new_logprobs, out.finish_reason, out.stop_reason)
                num_new = len(completion.detokenizer.output_token_ids) - num_before  # none past a stop string
            except Exception as exc:  # noqa: BLE001 -- this request's alone
                logger.error("request %s failed in the step's output stage; it ends alone, the engine serves on: "
                             "%s: %s", state.request_id, type(exc).__name__, exc, exc_info=exc)
                self._fail(state, f"the request failed inside the engine (output): {type(exc).__name__}: {exc}",
                           result)
                continue
            if num_new:
                if state.metrics.first_token_time is None:
                    state.metrics.first_token_time = now
                    result.stats.num_prompt_tokens += len(state.prompt_token_ids)
                    result.stats.time_to_first_tokens.append(now - state.metrics.arrival_time)
                state.metrics.last_token_time = now
                state.num_generated_tokens += num_new
                result.stats.num_generation_tokens += num_new
            if completion.detokenizer.finished:
                del self.parents[out.request_id]
                if not out.finished:  # a stop string: the core still runs it
                    result.reqs_to_abort.append(out.request_id)
        for state in touched.values():
            self._report(state, result)
        return result

    def abort_requests(self, request_ids: Iterable[str]) -> OutputProcessorResult:
        """Ends requests here (finish_reason "abort", the partial text kept);
        the result holds their final outputs and the core sequences to abort.
        Unknown or finished ids are ignored."""
        result = OutputProcessorResult([], [], IterationStats())
        for request_id in request_ids:
            state = self.states.get(request_id)
            if state is None:
                continue
            for completion in state.completions:
                completion.detokenizer.finish("abort")
                if self.parents.pop(completion.child_id, None) is not None:
                    result.reqs_to_abort.append(completion.child_id)
            self._report(state, result, always=True)
        return result

    def fail_all(self) -> None:
        """Forgets every request (the engine died)."""
        self.states.clear()
        self.parents.clear()

    @staticmethod
    def _completion(state: RequestState, out: EngineCoreOutput) -> Completion:
        return next(c for c in state.completions if c.child_id == out.request_id)

    def _fail(self, state: RequestState, error: str, result: OutputProcessorResult) -> None:
        """Ends the whole request (all n completions) with finish_reason "error"."""
        state.error = error
        for completion in state.completions:
            completion.detokenizer.finish("error")
            if self.parents.pop(completion.child_id, None) is not None:
                result.reqs_to_abort.append(completion.child_id)

    def _report(self, state: RequestState, result: OutputProcessorResult, always: bool = False) -> None:
        """Adds the request's output (per its kind) and, once finished, its stats to the result."""
        finished = state.finished
        if finished:
            self.states.pop(state.request_id, None)
        if finished or always or state.output_kind is not RequestOutputKind.FINAL_ONLY:
            output = state.output()
            result.request_outputs.append(output)
            if finished:
                reasons = {c.finish_reason for c in output.outputs}
                result.stats.finished.append(FinishedRequestStats(
                    next(r for r in REASON_ORDER if r in reasons), len(state.prompt_token_ids),
                    state.num_generated_tokens, max(len(c.detokenizer.output_token_ids) for c in state.completions),
                    state.metrics))
