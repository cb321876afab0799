"""EngineCore: the scheduler and the executor, stepping sequences given as
token ids and returning each step's new token ids. It knows no text
(tokenization, detokenization and stop strings are the front end's: LLMEngine
in process, AsyncLLM beside an engine-core process) and no tensors: the
workers behind the executor own the model, the sampler and the generators.

Each step (vLLM v1's shape): scheduler.schedule() ->
executor.execute_model(scheduler output) -> scheduler.update_from_output
(the worker's sampled ids) -> token-level stop checks -> EngineCoreOutputs.

Async scheduling (the default on a GPU): a step is queued on the workers and
the core then reads the previous step's samples and checks their stops while
the device computes. The next step is scheduled before those samples reach
the host (the worker copies their input ids on the device), so a sequence
that stops spends one more row of one step, whose token is dropped.
Sequences with penalties need every sampled id on the host, and so do
constrained ones (structured outputs: the next step's bitmask comes from the
matcher advanced by the last token): while one runs, the core reads each
step's ids before it schedules the next, so the device idles while the host
accepts the tokens, fills the bitmask and prepares the step.

A sequence fails alone: the worker reports the sequences whose own work in a
step failed (ModelRunnerOutput.failed); they end with finish_reason "error"
and their reason, and free their blocks, while the others go on. What the
worker cannot pin on a sequence raises out of the step: the engine is dead.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable

from pagoda.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig
from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.request import Request, RequestStatus
from pagoda.core.scheduler import Scheduler, SchedulerOutput
from pagoda.engine.core_messages import EngineCoreOutput, EngineCoreReady, EngineCoreRequest, SchedulerStats
from pagoda.engine.structured_output import StructuredOutputManager
from pagoda.executor import get_executor_class
from pagoda.executor.abstract import StepFuture
from pagoda.logger import init_logger
from pagoda.outputs import TokenLogprobs

logger = init_logger(__name__)

# How long an idle core waits for a grammar to compile before it looks at
# its inbox again.
COMPILE_POLL_S = 0.01

# What front ends may call on the core by name (call_utility), in process or
# across the core's channel.
UTILITY_METHODS = frozenset({"reset_prefix_cache"})

_FINISH_STATUS = {
    "stop": RequestStatus.FINISHED_STOPPED,
    "length": RequestStatus.FINISHED_LENGTH,
    "timeout": RequestStatus.FINISHED_TIMEOUT,
    "error": RequestStatus.FINISHED_ERROR,
}


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
    """A step sent to the workers, before the core reads its results."""

    scheduled: SchedulerOutput
    requests: dict[str, Request]  # the step's requests: an id may be reused once one ends
    future: StepFuture


class EngineCore:
    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, scheduler_config: SchedulerConfig,
                 parallel_config: ParallelConfig | None = None, eos_token_ids: Iterable[int] = (), tokenizer=None):
        self.model_config = model_config
        self.parallel_config = parallel_config = parallel_config or ParallelConfig()
        self.eos_token_ids = sorted(eos_token_ids)
        self._eos = frozenset(self.eos_token_ids)
        self.executor = get_executor_class(parallel_config)(
            model_config, cache_config, scheduler_config, parallel_config, self.eos_token_ids
        )
        self.kv_cache_manager = KVCacheManager(
            self.executor.num_blocks, cache_config.block_size, enable_caching=cache_config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.kv_cache_manager,
            scheduler_config.max_num_seqs,
            scheduler_config.max_num_batched_tokens,
            policy=scheduler_config.scheduling_policy,
        )
        self.async_scheduling = scheduler_config.async_scheduling
        if self.async_scheduling is None:
            self.async_scheduling = model_config.device.type == "cuda"
        self._in_flight: _LaunchedStep | None = None  # async scheduling: the step queued last
        self.sequences: dict[str, _Sequence] = {}
        # Sequences whose next step needs every earlier id on the host
        # (penalties, structured outputs).
        self._num_need_ids = 0
        # Structured outputs: made on the first constrained sequence, with the
        # front end's tokenizer where it shares this process (else loaded then).
        self._tokenizer = tokenizer
        self._structured: StructuredOutputManager | None = None
        self._compiling: dict[str, Request] = {}  # sequences waiting for their grammar, not scheduled yet
        # Periodic stats line (pagoda.metrics.StatLogger); None = off.
        self.stat_logger = None
        self._ended: list[EngineCoreOutput] = []  # sequences ended outside a step's samples, reported by step()

    def ready_message(self) -> EngineCoreReady:
        config = self.model_config
        return EngineCoreReady(config.max_model_len, self.executor.num_blocks, self.kv_cache_manager.block_size,
                               self.async_scheduling, str(config.torch_dtype).removeprefix("torch."), str(config.device))

    def shutdown(self) -> None:
        if self._structured is not None:
            self._structured.shutdown()
        self.executor.shutdown()

    def _structured_outputs(self) -> StructuredOutputManager:
        if self._structured is None:
            def tokenizer():
                if self._tokenizer is None:
                    from pagoda.engine.processor import load_tokenizer

                    return load_tokenizer(self.model_config)
                return self._tokenizer

            self._structured = StructuredOutputManager(self.model_config.hf_config.vocab_size, self.eos_token_ids,
                                                       tokenizer)
        return self._structured

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
                               request.priority, max_num_tokens, request.want_prompt_logprobs)
        deadline = None
        if params.timeout_seconds is not None:
            # Monotonic: a wall-clock jump must not end or extend requests.
            deadline = time.monotonic() - (time.time() - request.arrival_time) + params.timeout_seconds
        if params.structured_outputs is not None:
            # Compiled on the pool; scheduled once compiled (_admit_compiled).
            self._structured_outputs().add(request.request_id, params.structured_outputs)
            self._compiling[request.request_id] = core_request
        else:
            self.scheduler.add_request(core_request)
        self.sequences[request.request_id] = _Sequence(
            core_request, deadline, [] if core_request.want_prompt_logprobs else None
        )
        self._num_need_ids += _needs_ids(params)

    def add_requests(self, requests: Iterable[EngineCoreRequest]) -> None:
        for request in requests:
            self.add_request(request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Ends sequences now and frees their KV blocks; the front end
        reports them (it asked). Unknown or finished ids are ignored."""
        for request_id in request_ids:
            if request_id in self.sequences:
                self._release(request_id, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return bool(self.sequences or self._ended)

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix (vLLM's name), so a workload run
        again computes its prompts again (benchmarks' repeated runs). False,
        changing nothing, while sequences hold KV blocks: finish or abort
        them first."""
        if self.kv_cache_manager.pool.reset_prefix_cache():
            logger.info("prefix cache reset")
            return True
        logger.warning("cannot reset the prefix cache while %d sequences hold KV blocks", len(self.sequences))
        return False

    def call_utility(self, method: str, args: tuple):
        """A front end's call of one of UTILITY_METHODS (UtilityCall);
        ValueError for any other name."""
        if method not in UTILITY_METHODS:
            raise ValueError(f"the engine core has no utility method {method!r} (it has: {sorted(UTILITY_METHODS)})")
        return getattr(self, method)(*args)

    def stats(self) -> SchedulerStats:
        kv, scheduler = self.kv_cache_manager, self.scheduler
        prefix = kv.prefix_cache_stats
        return SchedulerStats(
            num_running=scheduler.num_running, num_waiting=scheduler.num_waiting, kv_cache_usage=kv.usage(),
            num_blocks=kv.pool.num_blocks, num_used_blocks=kv.pool.num_blocks - kv.num_free_blocks,
            prefix_cache_queries=prefix.queries, prefix_cache_hits=prefix.hits,
            num_preemptions=scheduler.num_preemptions, prefix_caching=kv.enable_caching,
        )

    # --- the step -----------------------------------------------------------

    def step(self) -> list[EngineCoreOutput]:
        """Schedules and sends one step, and returns what the sequences
        gained: this step's tokens, or with async scheduling the previous
        step's, plus sequences that ended without a token (deadline, no room
        in the KV cache, a failure)."""
        self._expire_deadlines()
        self._admit_compiled()
        outputs: list[EngineCoreOutput] = []
        if self._in_flight is not None and self._num_need_ids:
            in_flight, self._in_flight = self._in_flight, None
            outputs += self._finish_step(in_flight)
        scheduled = self.scheduler.schedule()
        for request in scheduled.capped:
            # The whole KV cache cannot hold its next token even alone.
            self._end(request.request_id, "length")
        if self._structured is not None and not scheduled.is_empty:
            grammar = self._structured.bitmask([item.request_id for item in scheduled.scheduled if item.sample])
            if grammar is not None:
                scheduled.grammar_request_ids, scheduled.grammar_bitmask = grammar
        if scheduled.is_empty and self._in_flight is None and self._compiling and not outputs and not self._ended:
            self._structured.wait_any(COMPILE_POLL_S)
        if not scheduled.is_empty or self._in_flight is not None:
            launched = None if scheduled.is_empty else self._launch(scheduled)
            if self.async_scheduling:
                launched, self._in_flight = self._in_flight, launched
            if launched is not None:
                outputs += self._finish_step(launched)
        outputs += self._ended
        self._ended = []
        return outputs

    def _admit_compiled(self) -> None:
        """Hands the sequences whose grammar compiled to the scheduler; those
        whose grammar failed to compile end with finish_reason "error"."""
        if not self._compiling:
            return
        ready, failed = self._structured.take_ready()
        for request_id in ready:
            self.scheduler.add_request(self._compiling.pop(request_id))
        for request_id, reason in failed.items():
            self._end(request_id, "error", reason)

    def _launch(self, scheduled: SchedulerOutput) -> _LaunchedStep:
        now = time.time()
        requests = {}
        for item in scheduled.scheduled:
            sequence = self.sequences[item.request_id]
            requests[item.request_id] = sequence.request
            if sequence.scheduled_time is None:
                sequence.scheduled_time = now
        return _LaunchedStep(scheduled, requests, self.executor.execute_model(scheduled))

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
        """Waits for a step's results and turns them into outputs: failed
        sequences ended, stop checks, finished sequences released."""
        result = step.future.result()
        live = self.scheduler.requests

        def current(request_id: str) -> bool:
            # Not a sequence that ended since (a stop found meanwhile, an
            # abort, a failure): that one's results are dropped.
            return live.get(request_id) is step.requests[request_id]

        for request_id, reason in result.failed.items():
            if current(request_id):
                self._end(request_id, "error", reason)
        for request_id, entries in result.prompt_logprobs.items():
            if current(request_id):
                self.sequences[request_id].prompt_logprobs += entries
        sampled = {request_id: token for request_id, token in zip(result.req_ids, result.sampled_token_ids)
                   if current(request_id)}
        advanced = self.scheduler.update_from_output(step.scheduled, sampled)
        logprobs = result.logprobs
        rows = {request_id: row for row, request_id in enumerate(result.req_ids)} if logprobs is not None else None
        outputs = []
        for request in advanced:
            sequence = self.sequences[request.request_id]  # advanced: still scheduled, so still here
            token_logprobs = None if rows is None else logprobs[rows[request.request_id]]
            token = request.output_token_ids[-1]
            finish_reason, stop_reason = check_stop(request, self._eos, self.model_config.max_model_len)
            error = None
            if self._structured is not None:
                allowed, terminated = self._structured.accept(request.request_id, token)
                if not allowed:  # no token was allowed (e.g. min_tokens masked the grammar's end)
                    finish_reason, error = "error", f"structured_outputs: token {token} does not follow the grammar"
                elif terminated and finish_reason is None:
                    finish_reason = "stop"
            output = EngineCoreOutput(request.request_id, [token], finish_reason, stop_reason,
                                      None if token_logprobs is None else [token_logprobs], error=error)
            self._first_report(sequence, output)
            if sequence.prompt_logprobs is not None and not sequence.prompt_logprobs_sent:
                output.prompt_logprobs, sequence.prompt_logprobs_sent = sequence.prompt_logprobs, True
            if finish_reason is not None:
                self._release(request.request_id, _FINISH_STATUS[finish_reason])
            outputs.append(output)
        if self.stat_logger is not None:  # the state after the step, finished sequences released
            self.stat_logger.record(step.scheduled, len(advanced), self.stats())
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

    def _release(self, request_id: str, status: RequestStatus) -> None:
        request = self.scheduler.requests.get(request_id)
        if request is not None:
            self.scheduler.finish(request, status)
        self._compiling.pop(request_id, None)
        if self._structured is not None:
            self._structured.remove(request_id)
        sequence = self.sequences.pop(request_id, None)
        if sequence is not None:
            self._num_need_ids -= _needs_ids(sequence.request.sampling_params)


def _needs_ids(params) -> bool:
    """Its next step needs every id sampled so far on the host."""
    return params.uses_penalties or params.structured_outputs is not None
