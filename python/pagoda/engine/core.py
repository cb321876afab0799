"""EngineCore: the scheduler, the model runner and the sampler, stepping
sequences given as token ids and returning each step's new token ids. It
knows no text: tokenization, detokenization and stop strings are the front
end's (LLMEngine in process, AsyncLLM beside an engine-core process).

Each step: scheduler decision -> runner inputs -> model -> sampler ->
token-level stop checks -> EngineCoreOutputs.

Async scheduling (the default on a GPU): a step is queued on the device and
the core then reads the previous step's samples and checks their stops while
the device computes. The next step is scheduled before those samples reach
the host (their input ids are copied on the device), so a sequence that
stops spends one more row of one step, whose token is dropped. Sequences with
penalties need every sampled id on the host: while one is in flight, steps
run one at a time.

A sequence fails alone. If a step raises in work done per sequence
(sampling inputs, sampling, prompt logprobs), the sequences that make it fail
are found by trying each alone, end with finish_reason "error" and their
reason, and free their blocks, while the step goes on for the others. Only
what no single sequence explains (the model's forward pass, a device fault)
propagates: the engine is then dead.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, TypeVar

import torch

from pagoda.config import CacheConfig, ModelConfig, SchedulerConfig
from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.request import Request, RequestStatus
from pagoda.core.scheduler import Scheduler, SchedulerOutput
from pagoda.engine.core_messages import EngineCoreOutput, EngineCoreReady, EngineCoreRequest, SchedulerStats
from pagoda.logger import init_logger
from pagoda.model_executor.layers.sampler import (
    DeviceSamplerOutput,
    Sampler,
    SamplingMetadata,
    compute_token_logprobs,
    make_generator,
)
from pagoda.outputs import TokenLogprobs
from pagoda.sampling_params import SamplingParams
from pagoda.worker import create_model_runner

logger = init_logger(__name__)

_FINISH_STATUS = {
    "stop": RequestStatus.FINISHED_STOPPED,
    "length": RequestStatus.FINISHED_LENGTH,
    "timeout": RequestStatus.FINISHED_TIMEOUT,
    "error": RequestStatus.FINISHED_ERROR,
}
# Stands in for a failed sequence's row in a re-run batch: greedy, no extras,
# so it cannot fail again; its token is dropped with the sequence.
_NEUTRAL_PARAMS = SamplingParams(temperature=0.0, max_tokens=None)
T = TypeVar("T")


def is_device_fault(exc: BaseException) -> bool:
    """Faults of the device or its memory, not of one request's values: a
    CUDA error leaves the context unusable for every request."""
    return isinstance(exc, (torch.AcceleratorError, torch.OutOfMemoryError)) or "CUDA error" in str(exc)


def check_stop(request: Request, eos_token_ids: frozenset[int], max_model_len: int) -> tuple[str | None, int | None]:
    """Token-level stops after a sequence's newest token, as (finish reason,
    stop token id): EOS or a stop token id (once past min_tokens; the
    sampler masks them before), max_tokens, max_model_len."""
    params = request.sampling_params
    token = request.output_token_ids[-1]
    num_output = len(request.output_token_ids)
    if num_output > params.min_tokens:
        if token in params.stop_token_ids:
            return "stop", token
        if not params.ignore_eos and token in eos_token_ids:
            return "stop", None
    if params.max_tokens is not None and num_output >= params.max_tokens:
        return "length", None
    if request.num_tokens >= max_model_len:
        return "length", None
    return None, None


@dataclass
class _Sequence:
    """The core's own state of a sequence beside the scheduler's Request."""

    request: Request
    deadline: float | None  # time.monotonic() after which it ends with "timeout"
    prompt_logprobs: list[TokenLogprobs] | None  # entries so far when asked for, else None
    scheduled_time: float | None = None
    reported: bool = False  # its first output (scheduled time, cached tokens) went out
    prompt_logprobs_sent: bool = False


@dataclass
class _LaunchedStep:
    """A step queued on the device, before the host reads its results."""

    scheduled: SchedulerOutput
    requests: list[Request]  # the ones that sample, in their rows' order
    samples: DeviceSamplerOutput | None
    uses_penalties: bool  # the next step needs these samples' ids on the host
    prompt_logits: list[tuple[str, int, torch.Tensor]] = field(default_factory=list)  # (id, first position, logits)


class EngineCore:
    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, scheduler_config: SchedulerConfig,
                 eos_token_ids: Iterable[int] = ()):
        self.model_config = model_config
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
        self.eos_token_ids = sorted(eos_token_ids)
        self._eos = frozenset(self.eos_token_ids)
        self.sequences: dict[str, _Sequence] = {}
        self.generators: dict[str, torch.Generator] = {}
        # Periodic stats line (pagoda.metrics.StatLogger); None = off.
        self.stat_logger = None
        self._ended: list[EngineCoreOutput] = []  # sequences ended outside a step's samples, reported by step()
        # A test hook: called as fault_hook(stage, request_ids) where a step
        # works on those sequences ("prepare", "sample"); an exception it
        # raises is handled as a failure of that work would be.
        self.fault_hook: Callable[[str, list[str]], None] | None = None

    def ready_message(self) -> EngineCoreReady:
        config = self.model_config
        return EngineCoreReady(config.max_model_len, self.runner.num_blocks, self.kv_cache_manager.block_size,
                               self.async_scheduling, str(config.torch_dtype).removeprefix("torch."), str(config.device))

    # --- requests -----------------------------------------------------------

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queues a sequence the front end has validated (ids in the
        vocabulary, the prompt shorter than max_model_len)."""
        if request.request_id in self.sequences:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        params = request.sampling_params
        max_len = self.model_config.max_model_len
        num_prompt = len(request.prompt_token_ids)
        max_num_tokens = max_len if params.max_tokens is None else min(max_len, num_prompt + params.max_tokens)
        core_request = Request(request.request_id, request.prompt_token_ids, params, request.arrival_time,
                               request.priority, max_num_tokens)
        deadline = None
        if params.timeout_seconds is not None:
            # Monotonic: a wall-clock jump must not end or extend requests.
            deadline = time.monotonic() - (time.time() - request.arrival_time) + params.timeout_seconds
        self.scheduler.add_request(core_request)
        self.sequences[request.request_id] = _Sequence(
            core_request, deadline, [] if request.want_prompt_logprobs and params.prompt_logprobs is not None else None
        )
        if params.seed is not None:
            self.generators[request.request_id] = make_generator(params.seed % 2**64, self.runner.device)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Ends sequences now and frees their KV blocks; the front end
        reports them (it asked). Unknown or finished ids are ignored."""
        for request_id in request_ids:
            if request_id in self.sequences:
                self._release(request_id, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return bool(self.sequences or self._ended)

    def stats(self) -> SchedulerStats:
        kv, scheduler = self.kv_cache_manager, self.scheduler
        prefix = kv.prefix_cache_stats
        return SchedulerStats(
            num_running=scheduler.num_running, num_waiting=scheduler.num_waiting, kv_cache_usage=kv.usage(),
            num_blocks=kv.pool.num_blocks, num_used_blocks=kv.pool.num_blocks - kv.num_free_blocks,
            prefix_cache_queries=prefix.queries, prefix_cache_hits=prefix.hits,
            num_preemptions=scheduler.num_preemptions,
        )

    # --- the step -----------------------------------------------------------

    def step(self) -> list[EngineCoreOutput]:
        """Schedules and queues one step, and returns what the sequences
        gained: this step's tokens, or with async scheduling the previous
        step's, plus sequences that ended without a token (deadline, no room
        in the KV cache, a failure)."""
        self._expire_deadlines()
        outputs: list[EngineCoreOutput] = []
        in_flight = self._in_flight
        if in_flight is not None and in_flight.uses_penalties:
            self._in_flight = None
            outputs += self._finish_step(in_flight)
        scheduled = self.scheduler.schedule()
        for request in scheduled.capped:
            # The whole KV cache cannot hold its next token even alone.
            self._end(request.request_id, "length")
        if not scheduled.is_empty or self._in_flight is not None:
            launched = None if scheduled.is_empty else self._launch(scheduled)
            if self.async_scheduling:
                launched, self._in_flight = self._in_flight, launched
            if launched is not None:
                outputs += self._finish_step(launched)
        outputs += self._ended
        self._ended = []
        return outputs

    def _launch(self, scheduled: SchedulerOutput) -> _LaunchedStep:
        """Runs the model and the sampler on the step, without waiting for the device."""
        now = time.time()
        prompt_logprob_ids = set()
        for item in scheduled.scheduled:
            sequence = self.sequences[item.request_id]
            if sequence.scheduled_time is None:
                sequence.scheduled_time = now
            if sequence.prompt_logprobs is not None and not self._prompt_logprobs_done(sequence):
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
            [(request_id, first, chunk) for request_id, (first, chunk) in prompt_logits.items()],
        )

    def _sampling_metadata(self, rows: list[Request | None], trial: bool = False) -> SamplingMetadata:
        """The sampler's inputs for these rows (None: a failed sequence's
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
        (None: a sequence failed earlier in the step). If it raises, each
        sequence is tried alone (trial(row, request)); those that fail alone
        are failed, and run goes again with None in their rows. Returns the
        rows and run's result. A failure that no single sequence explains,
        or a device fault, propagates."""
        try:
            self._inject(stage, rows)
            return rows, run(rows)
        except Exception as exc:  # noqa: BLE001 -- narrowed to single sequences below, else re-raised
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

    def _fail(self, request_id: str, stage: str, exc: BaseException) -> None:
        """Ends a sequence with finish_reason "error" and frees its blocks."""
        logger.error("request %s failed in the step's %s stage; it ends alone, the engine serves on: %s: %s",
                     request_id, stage, type(exc).__name__, exc, exc_info=exc)
        self._end(request_id, "error", f"the request failed inside the engine ({stage}): {type(exc).__name__}: {exc}")

    def _end(self, request_id: str, reason: str, error: str | None = None) -> None:
        """Ends a sequence outside its samples; step() reports it."""
        sequence = self.sequences.get(request_id)
        if sequence is None:
            return
        output = EngineCoreOutput(request_id, [], reason, error=error)
        self._first_report(sequence, output)
        self._ended.append(output)
        self._release(request_id, _FINISH_STATUS[reason])

    def _finish_step(self, step: _LaunchedStep) -> list[EngineCoreOutput]:
        """Waits for a launched step's samples and turns them into outputs:
        stop checks, finished sequences released."""
        sampled: dict[str, int] = {}
        logprobs: dict[str, TokenLogprobs] = {}
        if step.samples is not None:
            result = step.samples.to_host()
            for row, request in enumerate(step.requests):
                # A sequence that ended since (a stop found meanwhile, an
                # abort) drops its token.
                if self.scheduler.requests.get(request.request_id) is request:
                    sampled[request.request_id] = result.sampled_token_ids[row]
                    if result.logprobs is not None and result.logprobs[row] is not None:
                        logprobs[request.request_id] = result.logprobs[row]
        for request_id, first_position, chunk_logits in step.prompt_logits:
            sequence = self.sequences.get(request_id)
            if sequence is not None:
                try:
                    self._add_prompt_logprobs(sequence, first_position, chunk_logits)
                except Exception as exc:  # noqa: BLE001 -- this sequence's alone
                    if is_device_fault(exc):
                        raise
                    self._fail(request_id, "prompt logprobs", exc)
                    sampled.pop(request_id, None)
        advanced = self.scheduler.update_from_output(step.scheduled, sampled)
        if self.stat_logger is not None:
            self.stat_logger.record(step.scheduled, num_generated_tokens=len(advanced))

        outputs = []
        for request in advanced:
            sequence = self.sequences[request.request_id]  # advanced: still scheduled, so still here
            token_logprobs = logprobs.get(request.request_id)
            finish_reason, stop_reason = check_stop(request, self._eos, self.model_config.max_model_len)
            output = EngineCoreOutput(request.request_id, [request.output_token_ids[-1]], finish_reason, stop_reason,
                                      None if token_logprobs is None else [token_logprobs])
            self._first_report(sequence, output)
            if sequence.prompt_logprobs is not None and not sequence.prompt_logprobs_sent:
                output.prompt_logprobs, sequence.prompt_logprobs_sent = sequence.prompt_logprobs, True
            if finish_reason is not None:
                self._release(request.request_id, _FINISH_STATUS[finish_reason])
            outputs.append(output)
        return outputs

    @staticmethod
    def _first_report(sequence: _Sequence, output: EngineCoreOutput) -> None:
        """A sequence's first output carries when it was first scheduled and
        its prefix-cache hit."""
        if not sequence.reported:
            sequence.reported = True
            output.scheduled_time = sequence.scheduled_time
            output.num_cached_tokens = max(sequence.request.num_cached_tokens, 0)

    def _expire_deadlines(self) -> None:
        """Ends every sequence whose timeout_seconds has passed, waiting or
        running, with finish_reason "timeout"."""
        now = time.monotonic()
        for request_id in [i for i, s in self.sequences.items() if s.deadline is not None and now >= s.deadline]:
            self._end(request_id, "timeout")

    @staticmethod
    def _prompt_logprobs_done(sequence: _Sequence) -> bool:
        return len(sequence.prompt_logprobs) >= sequence.request.num_prompt_tokens - 1

    def _add_prompt_logprobs(self, sequence: _Sequence, first_position: int, logits: torch.Tensor) -> None:
        """Scores prompt tokens first_position+1.. (a recomputation after
        preemption repeats positions already scored: those are skipped)."""
        entries = sequence.prompt_logprobs
        skip = len(entries) - first_position
        if skip >= logits.shape[0]:
            return
        prompt = sequence.request.prompt_token_ids
        targets = prompt[first_position + skip + 1 : first_position + logits.shape[0] + 1]
        entries += compute_token_logprobs(logits[skip:], targets, sequence.request.sampling_params.prompt_logprobs)

    def _release(self, request_id: str, status: RequestStatus) -> None:
        request = self.scheduler.requests.get(request_id)
        if request is not None:
            self.scheduler.finish(request, status)
        self.sequences.pop(request_id, None)
        self.generators.pop(request_id, None)
