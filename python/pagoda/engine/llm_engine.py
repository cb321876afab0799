"""LLMEngine: add_request / step / abort_request over the scheduler, the model
runner, the sampler and the output processor -- all in one process.

Data flows one way each step: scheduler decision -> runner inputs -> model ->
sampler -> detokenizer/stop checks -> RequestOutputs.

Async scheduling (the default on a GPU): a step is queued on the device and the
engine then reads the previous step's samples, detokenizes them and checks
stops while the device computes -- the host's Python work hides behind the
GPU's. The next step is scheduled before those samples reach the host (their
input ids are copied on the device), so a request that stops spends one more
row of one step, whose token is dropped. Requests with penalties need every
sampled id on the host: while one is in flight, steps run one at a time.

A request fails alone. Its fields are checked when it is added; if a step
still raises in work done per request (sampling inputs, sampling, output
processing), the requests that make it fail are found by trying each alone,
end with finish_reason "error" and RequestOutput.error, and free their blocks,
while the step goes on for the others. Only what no single request explains
(the model's forward pass, a device fault) propagates: the engine is then dead.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, TypeVar

import torch

from pagoda.config import CacheConfig, ModelConfig, SchedulerConfig
from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.request import Request, RequestStatus
from pagoda.core.scheduler import Scheduler, SchedulerOutput
from pagoda.engine.detokenizer import IncrementalDetokenizer, make_prompt_logprobs
from pagoda.engine.output_processor import Completion, RequestState
from pagoda.logger import init_logger
from pagoda.model_executor.layers.sampler import (
    DeviceSamplerOutput,
    Sampler,
    SamplingMetadata,
    compute_token_logprobs,
    make_generator,
)
from pagoda.outputs import RequestMetrics, RequestOutput, RequestOutputKind
from pagoda.sampling_params import SamplingParams
from pagoda.worker import create_model_runner

logger = init_logger(__name__)

_FINISH_STATUS = {
    "stop": RequestStatus.FINISHED_STOPPED,
    "length": RequestStatus.FINISHED_LENGTH,
    "abort": RequestStatus.FINISHED_ABORTED,
    "timeout": RequestStatus.FINISHED_TIMEOUT,
    "error": RequestStatus.FINISHED_ERROR,
}
# Stands in for a failed request's row in a re-run batch: greedy, no extras,
# so it cannot fail again; its token is dropped with the request.
_NEUTRAL_PARAMS = SamplingParams(temperature=0.0, max_tokens=None)
T = TypeVar("T")


def is_device_fault(exc: BaseException) -> bool:
    """Faults of the device or its memory, not of one request's values: a
    CUDA error leaves the context unusable for every request."""
    return isinstance(exc, (torch.AcceleratorError, torch.OutOfMemoryError)) or "CUDA error" in str(exc)


@dataclass
class _LaunchedStep:
    """A step queued on the device, before the host reads its results."""

    scheduled: SchedulerOutput
    requests: list[Request]  # the ones that sample, in their rows' order
    samples: DeviceSamplerOutput | None
    uses_penalties: bool  # the next step needs these samples' ids on the host
    prompt_logits: list[tuple[RequestState, int, torch.Tensor]]  # (request, first position, logits)


def load_tokenizer(model_config: ModelConfig):
    from transformers import AutoTokenizer

    if model_config.tokenizer is not None:
        return AutoTokenizer.from_pretrained(model_config.tokenizer)
    if model_config.gguf_file:
        return AutoTokenizer.from_pretrained(model_config.folder, gguf_file=model_config.gguf_file)
    return AutoTokenizer.from_pretrained(model_config.folder)


class LLMEngine:
    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, scheduler_config: SchedulerConfig):
        self.model_config = model_config
        # skip_tokenizer_init (vLLM's): token-id prompts only, outputs without text.
        self.tokenizer = None if model_config.skip_tokenizer_init else load_tokenizer(model_config)
        self.runner = create_model_runner(model_config, cache_config, scheduler_config)
        self.kv_cache_manager = KVCacheManager(
            self.runner.num_blocks, cache_config.block_size, enable_caching=cache_config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.kv_cache_manager,
            scheduler_config.max_num_seqs,
            scheduler_config.max_num_batched_tokens,
            policy=scheduler_config.scheduling_policy,
        )
        self.sampler = Sampler()
        self.async_scheduling = scheduler_config.async_scheduling
        if self.async_scheduling is None:
            self.async_scheduling = self.runner.device.type == "cuda"
        self._in_flight: _LaunchedStep | None = None  # async scheduling: the step queued last
        self.vocab_size = model_config.hf_config.vocab_size
        self.eos_token_ids = _eos_token_ids(model_config, self.tokenizer)
        self.generation_defaults = model_config.generation_config
        self.states: dict[str, RequestState] = {}
        self.parents: dict[str, RequestState] = {}  # child (scheduler) request id -> its request
        self.generators: dict[str, torch.Generator] = {}
        self.completions: dict[str, Completion] = {}
        # Periodic stats line (pagoda.metrics.StatLogger); None = off. Set by
        # EngineArgs(disable_log_stats=False) and AsyncLLM.
        self.stat_logger = None
        self._failed: list[RequestOutput] = []  # requests failed inside a step, reported by the next step()
        # A test hook: called as fault_hook(stage, request_ids) where a step
        # works on those requests ("prepare", "sample", "output"); an
        # exception it raises is handled as a failure of that work would be.
        self.fault_hook: Callable[[str, list[str]], None] | None = None

    # --- requests -----------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | dict[str, Any],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
    ) -> None:
        """Validates and queues a request; ValueError (naming the field) on bad
        input. With output_kind FINAL_ONLY, step() returns the request's output
        only when it finishes (no per-token copies: the offline LLM's choice)."""
        if request_id in self.states:
            raise ValueError(f"request_id {request_id!r} is already in use")
        params = (params or SamplingParams()).clone()
        if self.generation_defaults:
            params.update_from_generation_config(self.generation_defaults)
        params.verify_vocab(self.vocab_size)
        if self.tokenizer is None and params.stop:
            raise ValueError("stop strings need a tokenizer, but the engine has skip_tokenizer_init=True: "
                             "use stop_token_ids")
        text, token_ids = self._tokenize(prompt)
        self._check_length(len(token_ids))
        arrival_time = time.time() if arrival_time is None else arrival_time
        state = RequestState(request_id, text, token_ids, params, [], RequestMetrics(arrival_time=arrival_time))
        state.final_only = output_kind is RequestOutputKind.FINAL_ONLY
        if params.timeout_seconds is not None:
            # Monotonic: a wall-clock jump must not end or extend requests.
            state.deadline = time.monotonic() - (time.time() - arrival_time) + params.timeout_seconds
        if params.prompt_logprobs is not None and len(token_ids) == 1:
            state.prompt_logprobs = [None]  # nothing predicts a lone first token
        for index in range(params.n):
            child_id = request_id if params.n == 1 else f"{index}_{request_id}"
            detokenizer = IncrementalDetokenizer(self.tokenizer, token_ids, params, eos_token_ids=self.eos_token_ids)
            state.completions.append(Completion(index, child_id, detokenizer))
            if params.seed is not None:
                # Seeds are 64-bit: the children's count on, wrapping around.
                self.generators[child_id] = make_generator((params.seed + index) % 2**64, self.runner.device)
            self.parents[child_id] = state
            self.scheduler.add_request(
                Request(child_id, token_ids, params, arrival_time, priority, self._max_num_tokens(token_ids, params))
            )
        self.states[request_id] = state

    def _max_num_tokens(self, token_ids: list[int], params: SamplingParams) -> int:
        max_len = self.model_config.max_model_len
        return max_len if params.max_tokens is None else min(max_len, len(token_ids) + params.max_tokens)

    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a dict prompt needs 'prompt' (text) or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("the prompt is text, but the engine has skip_tokenizer_init=True (no tokenizer): "
                                 "pass token ids (a list of ints or {'prompt_token_ids': [...]})")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)):
            return None, self._check_ids(prompt)
        raise ValueError(f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def _check_ids(self, token_ids) -> list[int]:
        token_ids = list(token_ids)
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in token_ids):
            raise ValueError("prompt_token_ids must be a list of ints")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids has ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        return token_ids

    def _check_length(self, num_prompt_tokens: int) -> None:
        if num_prompt_tokens == 0:
            raise ValueError("prompt is empty: it needs at least one token")
        max_len = self.model_config.max_model_len
        if num_prompt_tokens >= max_len:
            raise ValueError(
                f"prompt has {num_prompt_tokens} tokens but max_model_len is {max_len}: "
                f"a prompt must leave room for at least one generated token"
            )

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Ends requests now (finish_reason "abort") and frees their KV blocks."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for request_id in request_ids:
            state = self.states.pop(request_id, None)
            if state is None:
                continue
            for completion in state.completions:
                if not completion.detokenizer.finished:
                    completion.detokenizer.finish("abort")
                self._release(completion.child_id, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return bool(self.states)

    def get_num_unfinished_requests(self) -> int:
        return len(self.states)

    # --- the step -----------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedules and queues one step, and returns the outputs of the
        requests that advanced (finished ones for the last time): this step's,
        or with async scheduling the previous step's."""
        outputs = self._expire_deadlines()
        in_flight = self._in_flight
        if in_flight is not None and in_flight.uses_penalties:
            self._in_flight = None
            outputs += self._finish_step(in_flight)
        scheduled = self.scheduler.schedule()
        for request in scheduled.capped:
            self._fail_capped(request)
        if not scheduled.is_empty or self._in_flight is not None:
            launched = None if scheduled.is_empty else self._launch(scheduled)
            if self.async_scheduling:
                launched, self._in_flight = self._in_flight, launched
            if launched is not None:
                outputs += self._finish_step(launched)
        outputs += self._failed
        self._failed = []
        return outputs

    def _launch(self, scheduled: SchedulerOutput) -> _LaunchedStep:
        """Runs the model and the sampler on the step, without waiting for the device."""
        now = time.time()
        prompt_logprob_ids = set()
        for item in scheduled.scheduled:
            state = self.parents[item.request_id]
            if state.metrics.first_scheduled_time is None:
                state.metrics.first_scheduled_time = now
                # Prompt tokens the first scheduling found in the prefix cache.
                state.num_cached_tokens = self.scheduler.requests[item.request_id].num_cached_tokens
            if self._wants_prompt_logprobs(item.request_id):
                prompt_logprob_ids.add(item.request_id)
        requests = [self.scheduler.requests[item.request_id] for item in scheduled.scheduled if item.sample]
        rows, metadata = requests, None
        if requests:
            # Built before the forward pass is queued: its host-to-device
            # copies then go ahead of the model's work on the GPU stream.
            rows, metadata = self._per_request("prepare", requests, self._sampling_metadata,
                                               lambda row, request: self._sampling_metadata([request], trial=True))
        previous = self._in_flight.samples if self._in_flight is not None else None
        logits, prompt_logits = self.runner.execute(
            scheduled, frozenset(prompt_logprob_ids), None if previous is None else previous.sampled
        )
        samples = None
        if requests:
            prepared = rows
            _, samples = self._per_request(
                "sample", rows,
                lambda rows: self.sampler.sample(logits, metadata if rows is prepared else self._sampling_metadata(rows)),
                lambda row, request: self.sampler.sample(logits[row : row + 1],
                                                         self._sampling_metadata([request], trial=True)),
            )
            samples.start_copy_to_host()
        return _LaunchedStep(
            scheduled,
            requests,
            samples,
            metadata is not None and metadata.uses_penalties,
            [(self.parents[child_id], first, chunk) for child_id, (first, chunk) in prompt_logits.items()],
        )

    def _sampling_metadata(self, rows: list[Request | None], trial: bool = False) -> SamplingMetadata:
        """The sampler's inputs for these rows (None: a failed request's
        neutral row). A trial samples with copies of the generators, so
        trying a row leaves its seeded stream where it was."""
        generators = [None if r is None else self.generators.get(r.request_id) for r in rows]
        if trial:
            generators = [None if g is None else g.clone_state() for g in generators]
        return SamplingMetadata.from_requests(
            [_NEUTRAL_PARAMS if r is None else r.sampling_params for r in rows],
            [() if r is None else r.output_token_ids for r in rows],
            prompt_token_ids=[() if r is None else r.prompt_token_ids for r in rows],
            generators=generators,
            eos_token_ids=self.eos_token_ids,
            device=self.runner.device,
            # This step's sample is pending too.
            num_output_tokens=[0 if r is None else r.num_output_tokens - 1 for r in rows],
        )

    def _per_request(self, stage: str, rows: list[Request | None], run: Callable[[list[Request | None]], T],
                     trial: Callable[[int, Request], Any]) -> tuple[list[Request | None], T]:
        """run(rows): one batched piece of a step over the sampling rows
        (None: a request failed earlier in the step). If it raises, each
        request is tried alone (trial(row, request)); those that fail alone
        are failed, and run goes again with None in their rows. Returns the
        rows and run's result. A failure that no single request explains,
        or a device fault, propagates."""
        try:
            self._inject(stage, rows)
            return rows, run(rows)
        except Exception as exc:  # noqa: BLE001 -- narrowed to single requests below, else re-raised
            if is_device_fault(exc):
                raise
            batch_error = exc
        rows = list(rows)
        failed = False
        for row, request in enumerate(rows):
            if request is None:
                continue
            try:
                self._inject(stage, [request])
                trial(row, request)
            except Exception as exc:  # noqa: BLE001
                if is_device_fault(exc):
                    raise
                self._fail(request.request_id, stage, exc)
                rows[row], failed = None, True
        if not failed:
            raise batch_error
        return rows, run(rows)

    def _inject(self, stage: str, rows: list[Request | None]) -> None:
        if self.fault_hook is not None:
            self.fault_hook(stage, [r.request_id for r in rows if r is not None])

    def _fail(self, child_id: str, stage: str, exc: BaseException) -> None:
        """Ends the whole request (all n completions) with finish_reason
        "error", frees its blocks, and queues its final output for step()."""
        state = self.parents.get(child_id)
        if state is None:
            return
        logger.error("request %s failed in the step's %s stage; it ends alone, the engine serves on: %s: %s",
                     state.request_id, stage, type(exc).__name__, exc, exc_info=exc)
        state.error = f"the request failed inside the engine ({stage}): {type(exc).__name__}: {exc}"
        for completion in state.completions:
            completion.detokenizer.finish("error")
            self._release(completion.child_id, RequestStatus.FINISHED_ERROR)
        self.states.pop(state.request_id, None)
        self._failed.append(state.output())

    def _fail_capped(self, request: Request) -> None:
        """A request the scheduler ended because the KV cache cannot hold
        its next token even alone: it finishes with "length"."""
        state = self.parents.get(request.request_id)
        if state is None:
            return
        completion = self._completion(state, request.request_id)
        completion.detokenizer.finish("length")
        self._release(request.request_id, RequestStatus.FINISHED_LENGTH)
        if state.finished:
            self.states.pop(state.request_id, None)
            self._failed.append(state.output())

    def _finish_step(self, step: _LaunchedStep) -> list[RequestOutput]:
        """Waits for a launched step's samples and turns them into outputs:
        detokenization, stop checks, finished requests released."""
        sampled: dict[str, int] = {}
        logprobs: dict[str, Any] = {}
        if step.samples is not None:
            result = step.samples.to_host()
            for row, request in enumerate(step.requests):
                # A request that ended since (a stop found meanwhile, an abort)
                # drops its token.
                if self.scheduler.requests.get(request.request_id) is request:
                    sampled[request.request_id] = result.sampled_token_ids[row]
                    if result.logprobs is not None:
                        logprobs[request.request_id] = result.logprobs[row]
        for state, first_position, chunk_logits in step.prompt_logits:
            if self.states.get(state.request_id) is state:
                try:
                    self._add_prompt_logprobs(state, first_position, chunk_logits)
                except Exception as exc:  # noqa: BLE001 -- this request's alone
                    if is_device_fault(exc):
                        raise
                    self._fail(state.completions[0].child_id, "output", exc)
        advanced = self.scheduler.update_from_output(step.scheduled, sampled)
        if self.stat_logger is not None:
            self.stat_logger.record(step.scheduled, num_generated_tokens=len(advanced))

        now = time.time()
        touched: dict[str, RequestState] = {}
        for request in advanced:
            state = self.parents.get(request.request_id)
            if state is None:
                continue  # a sibling failed earlier in this loop
            completion = state.completions[0] if state.params.n == 1 else self._completion(state, request.request_id)
            try:
                if self.fault_hook is not None:
                    self.fault_hook("output", [request.request_id])
                row_logprobs = logprobs.get(request.request_id)
                completion.detokenizer.append([request.output_token_ids[-1]],
                                              None if row_logprobs is None else [row_logprobs])
            except Exception as exc:  # noqa: BLE001 -- this request's alone
                self._fail(request.request_id, "output", exc)
                continue
            if not completion.detokenizer.finished and request.num_tokens >= self.model_config.max_model_len:
                completion.detokenizer.finish("length")
            if state.metrics.first_token_time is None:
                state.metrics.first_token_time = now
            state.metrics.last_token_time = now
            if completion.detokenizer.finished:
                self._release(request.request_id, _FINISH_STATUS[completion.detokenizer.finish_reason])
            touched[state.request_id] = state
        outputs = []
        for state in touched.values():
            if state.error is not None:
                continue  # its final output is queued already
            if not state.final_only or state.finished:
                outputs.append(state.output())
            if state.finished:
                self.states.pop(state.request_id, None)
        return outputs

    def _expire_deadlines(self) -> list[RequestOutput]:
        """Ends every request whose timeout_seconds has passed, waiting or
        running, with finish_reason "timeout" and its partial text."""
        now = time.monotonic()
        expired = [s for s in self.states.values() if s.deadline is not None and now >= s.deadline]
        outputs = []
        for state in expired:
            for completion in state.completions:
                if not completion.detokenizer.finished:
                    completion.detokenizer.finish("timeout")
                    self._release(completion.child_id, RequestStatus.FINISHED_TIMEOUT)
            outputs.append(state.output())
            del self.states[state.request_id]
        return outputs

    def _wants_prompt_logprobs(self, child_id: str) -> bool:
        """Prompt logprobs are asked for, not complete yet, and computed once
        per request (by its first completion)."""
        state = self.parents[child_id]
        return (
            state.params.prompt_logprobs is not None
            and state.prompt_logprobs is None
            and state.completions[0].child_id == child_id
        )

    def _add_prompt_logprobs(self, state: RequestState, first_position: int, logits: torch.Tensor) -> None:
        """Scores prompt tokens first_position+1.. (a recomputation after
        preemption repeats positions already scored: those are skipped)."""
        done = len(state.prompt_logprob_entries)
        skip = done - first_position
        if skip >= logits.shape[0]:
            return
        targets = state.prompt_token_ids[first_position + skip + 1 : first_position + logits.shape[0] + 1]
        state.prompt_logprob_entries += compute_token_logprobs(logits[skip:], targets, state.params.prompt_logprobs)
        if len(state.prompt_logprob_entries) == len(state.prompt_token_ids) - 1:
            state.prompt_logprobs = make_prompt_logprobs(state.prompt_logprob_entries, self.tokenizer)

    @staticmethod
    def _completion(state: RequestState, child_id: str) -> Completion:
        return next(c for c in state.completions if c.child_id == child_id)

    def _release(self, child_id: str, status: RequestStatus) -> None:
        request = self.scheduler.requests.get(child_id)
        if request is not None:
            self.scheduler.finish(request, status)
        self.parents.pop(child_id, None)
        self.generators.pop(child_id, None)


def _eos_token_ids(model_config: ModelConfig, tokenizer) -> list[int]:
    ids = set()
    for source in (model_config.generation_config.get("eos_token_id"), getattr(model_config.hf_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(i for i in source if isinstance(i, int))
    # An id past the model's logits (a tokenizer larger than the model) can
    # never be sampled, and the sampler could not mask it.
    vocab_size = model_config.hf_config.vocab_size
    return sorted(i for i in ids if 0 <= i < vocab_size)
