"""From sampled token ids to what callers see: per completion an incremental
detokenizer (text, stop strings, finish reasons, logprobs), per request the n
completions gathered into one RequestOutput."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pagoda.engine.detokenizer import IncrementalDetokenizer
from pagoda.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagoda.sampling_params import SamplingParams


@dataclass
class Completion:
    """One of a request's n samples: a scheduler Request id and its text state."""

    index: int
    child_id: str
    detokenizer: IncrementalDetokenizer

    def output(self) -> CompletionOutput:
        d = self.detokenizer
        return CompletionOutput(
            index=self.index,
            text=d.visible_text,  # never a held-back partial stop string: streamed text only grows
            token_ids=list(d.output_token_ids),
            cumulative_logprob=d.cumulative_logprob,
            logprobs=d.logprobs,
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
    deadline: float | None = None  # time.monotonic() after which the request ends with "timeout"
    prompt_logprobs: list | None = None
    prompt_logprob_entries: list = field(default_factory=list)  # TokenLogprobs for prompt tokens 1.. so far
    num_cached_tokens: int = 0
    final_only: bool = False  # step() reports it only when finished (RequestOutputKind.FINAL_ONLY)
    error: str | None = None  # why it failed inside the engine (RequestOutput.error)

    @property
    def finished(self) -> bool:
        return all(c.detokenizer.finished for c in self.completions)

    def output(self) -> RequestOutput:
        finished = self.finished
        if finished and self.metrics.finished_time is None:
            self.metrics.finished_time = time.time()
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=self.prompt_logprobs,
            outputs=[c.output() for c in self.completions],
            finished=finished,
            metrics=self.metrics,
            num_cached_tokens=self.num_cached_tokens,
            error=self.error,
        )
