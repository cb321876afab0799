"""AsyncLLM (vLLM's name): the engine behind an asyncio streaming API, for
servers. `async for output in llm.generate(prompt, params, request_id)` yields
RequestOutputs as tokens arrive; many callers stream concurrently, each
sharing the engine's continuous batching.

The front end lives here: tokenization and checks (Processor), then
detokenization, stop strings and outputs (OutputProcessor). The engine core
(scheduler, model, sampler) runs either
  - in its own process (multiprocess=True, what `pagoda serve` runs, vLLM v1's
    design): the model steps in an interpreter of its own, so the GIL never
    makes the GPU wait for HTTP, tokenization or streaming; one message per
    step brings every request's new token ids (MPClient), or
  - in a thread of this process (the default here, and from_engine): simpler
    to debug and to look inside in tests (InprocClient).

Outputs of a step are processed on the client's thread under one lock and
handed to each caller's event loop in one call per loop per step. A caller
that falls behind gets its outputs merged (a delta stream receives the new
tokens of several steps as one output), so a slow consumer costs one
wake-up, not one per token.

A request that fails inside a step fails alone: its caller gets
RequestFailedError and the engine serves on. If the engine core itself dies,
every waiter gets EngineDeadError (not a hang) and later calls fail at once.
check_health() also tells a stalled engine (work pending, no step finished
for a while) from a busy one.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import threading
import time
import weakref
from collections import defaultdict
from typing import Any, AsyncIterator

from pagoda.engine.arg_utils import EngineArgs
from pagoda.engine.core_client import CoreStart, EngineCoreDiedError, InprocClient, MPClient
from pagoda.engine.core_messages import EngineCoreOutputs, SchedulerStats
from pagoda.engine.llm_engine import LLMEngine
from pagoda.engine.output_processor import IterationStats, OutputProcessor, OutputProcessorResult
from pagoda.engine.processor import Processor, eos_token_ids, front_end_model_config, load_tokenizer
from pagoda.logger import init_logger
from pagoda.outputs import CompletionOutput, RequestOutput, RequestOutputKind  # noqa: F401 -- re-exported
from pagoda.sampling_params import SamplingParams

logger = init_logger(__name__)


class EngineDeadError(RuntimeError):
    """The engine stopped (a fault no request explains, its process ended,
    or shutdown()); the AsyncLLM must be recreated. __cause__ holds the
    original exception."""


class RequestFailedError(RuntimeError):
    """This request failed inside an engine step (RequestOutput.error says
    how); the engine freed its blocks and serves every other request on."""


class EngineStalledError(RuntimeError):
    """The engine is alive and has work but has not finished a step for
    longer than the caller allows (a hung kernel, a deadlock)."""


class _Collector:
    """Where one request's outputs wait for its caller (on the caller's
    loop): at most one pending item; a newer output merges into it (deltas
    concatenated, cumulative replaced), an exception replaces it."""

    def __init__(self, delta: bool):
        self.delta = delta
        self.item: RequestOutput | BaseException | None = None
        self.ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        if self.delta and isinstance(self.item, RequestOutput) and isinstance(item, RequestOutput):
            item = _merge_deltas(self.item, item)
        elif isinstance(self.item, BaseException):
            return  # the request is over
        self.item = item
        self.ready.set()

    async def get(self) -> RequestOutput | BaseException:
        while self.item is None:
            await self.ready.wait()
        item, self.item = self.item, None
        self.ready.clear()
        return item


def _merge_deltas(old: RequestOutput, new: RequestOutput) -> RequestOutput:
    """`new` appended to `old`, in place: a pending delta is the collector's
    own (fresh lists, not seen by the caller yet), and a lagging caller must
    not make every step copy what waits."""
    for a, b in zip(old.outputs, new.outputs):
        a.text += b.text
        a.token_ids += b.token_ids
        if a.logprobs is not None and b.logprobs is not None:
            a.logprobs += b.logprobs
        a.cumulative_logprob, a.finish_reason, a.stop_reason = b.cumulative_logprob, b.finish_reason, b.stop_reason
    old.finished, old.metrics, old.prompt_logprobs, old.error = new.finished, new.metrics, new.prompt_logprobs, new.error
    old.num_cached_tokens = new.num_cached_tokens
    return old


class RequestStream:
    """A submitted request's outputs (AsyncLLM.submit): iterate it; the last
    output has finished=True, and an engine failure is raised from the
    iteration. close() -- or dropping the stream unfinished, at once in
    CPython -- aborts the request and frees its KV blocks."""

    def __init__(self, engine: AsyncLLM, request_id: str, collector: _Collector):
        self._engine, self.request_id, self._collector = engine, request_id, collector
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._collector.get()
        if isinstance(item, BaseException):
            self.finished = True  # the engine already dropped the request
            raise item
        self.finished = item.finished
        return item

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            self._engine._abort(self.request_id, notify=False)

    def __del__(self) -> None:
        if not self.finished and self._engine.is_running:
            self.close()


class AsyncLLM:
    """AsyncLLM(model, **engine_args) with LLM's arguments (EngineArgs);
    multiprocess=True runs the engine core in its own process.
    AsyncLLM.from_engine(engine) wraps an existing LLMEngine (in process).
    Stats logging is on by default (disable_log_stats=True turns it off).

    stat_loggers: objects with record(stats: IterationStats), called on the
    client's thread after each step's outputs and each abort (e.g. the
    server's PrometheusStatLogger)."""

    def __init__(self, model: str, disable_log_stats: bool = False, stats_interval: float = 10.0,
                 multiprocess: bool = False, **engine_args):
        args = EngineArgs(model=model, disable_log_stats=disable_log_stats, stats_interval=stats_interval, **engine_args)
        if multiprocess:
            self._start_process(args)
        else:
            self._start_inproc(args.create_engine())

    @classmethod
    def from_engine(cls, engine: LLMEngine, disable_log_stats: bool = False,
                    stats_interval: float = 10.0) -> AsyncLLM:
        self = cls.__new__(cls)
        if not disable_log_stats and engine.core.stat_logger is None:
            from pagoda.metrics import StatLogger

            engine.core.stat_logger = StatLogger(stats_interval)
        self._start_inproc(engine)
        return self

    @classmethod
    def from_engine_args(cls, args: EngineArgs, multiprocess: bool = True, core_address: str | None = None,
                         core_pid: int | None = None, client_index: int = 0) -> AsyncLLM:
        """With multiprocess, a new engine-core process -- or, given
        core_address and core_pid, a front end of one already running (an
        API server process beside others; client_index tells them apart)."""
        self = cls.__new__(cls)
        if not multiprocess:
            self._start_inproc(args.create_engine())
        else:
            self._start_process(args, core_address, core_pid, client_index)
        return self

    # --- start-up ---------------------------------------------------------------

    def _init_front_end(self, model_config, tokenizer, processor: Processor, output_processor: OutputProcessor,
                        scheduling_policy: str, client_index: int) -> None:
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.processor = processor
        self.output_processor = output_processor
        self.scheduling_policy = scheduling_policy
        self.client_index = client_index
        # Guards the output processor and the collectors: callers add and
        # abort from their loops while the client's thread processes outputs.
        self._lock = threading.Lock()
        self._collectors: dict[str, tuple[asyncio.AbstractEventLoop, _Collector]] = {}
        self._dead: BaseException | None = None
        self._woke = time.monotonic()  # when work last arrived at an idle engine
        self.stat_loggers: list = []
        self._scheduler_stats = SchedulerStats()  # the core's, after its latest step

    def _start_inproc(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._init_front_end(engine.model_config, engine.tokenizer, engine.processor, engine.output_processor,
                             engine.scheduler.policy, 0)
        self.client = InprocClient(engine.core, self._on_outputs, self._on_dead)
        self.client.start()

    def _start_process(self, args: EngineArgs, core_address: str | None = None, core_pid: int | None = None,
                       client_index: int = 0) -> None:
        self.engine = None  # the core is in another process
        # Started first: the core imports and loads while this process reads its tokenizer.
        start = CoreStart(args) if core_address is None else None
        with start.cancelled_on_failure() if start is not None else contextlib.nullcontext():
            model_config = front_end_model_config(args)
            tokenizer = None if model_config.skip_tokenizer_init else load_tokenizer(model_config)
        process = socket_dir = None
        if start is not None:
            process, core_address, socket_dir = start.finish(eos_token_ids(model_config, tokenizer))
        self._init_front_end(model_config, tokenizer, Processor(model_config, tokenizer), OutputProcessor(tokenizer),
                             args.scheduling_policy, client_index)
        try:
            self.client = MPClient(core_address, self._on_outputs, self._on_dead, client_index, core_pid, process,
                                   socket_dir)
        except BaseException:
            if process is not None:
                process.kill()
            raise
        model_config.adopt_core_start(self.client.ready)
        self.client.start()
        if process is not None:
            # A caller that never calls shutdown() must not leave the core
            # running (it ignores SIGTERM, so multiprocessing's own exit
            # handler would wait for it forever).
            atexit.register(_shutdown_at_exit, weakref.ref(self))

    @property
    def ready(self):
        """What the engine core's start-up decided: max_model_len, KV blocks,
        block size, async scheduling, dtype, device."""
        return self.client.ready

    @property
    def scheduler_stats(self) -> SchedulerStats:
        """The engine core's running/waiting sequences, KV blocks, prefix
        cache and preemption counts: read now from a core in this process
        (plain ints), else as its latest step's message brought them."""
        return self.engine.core.stats() if self.engine is not None else self._scheduler_stats

    @property
    def core_pid(self) -> int | None:
        """The engine-core process (None: the core runs in this process)."""
        return getattr(self.client, "core_pid", None)

    @property
    def vocab_size(self) -> int:
        return self.processor.vocab_size

    # --- the caller's side (event loop) ---------------------------------------

    async def generate(
        self,
        prompt: str | list[int] | dict[str, Any],
        sampling_params: SamplingParams | None,
        request_id: str,
        priority: int = 0,
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
    ) -> AsyncIterator[RequestOutput]:
        """Streams one request's outputs; the last has finished=True. A bad
        request raises ValueError (from the first iteration); a dead engine
        raises EngineDeadError. Cancelling the task, or closing the iterator,
        aborts the request and frees its blocks (after a `break` that happens
        when the iterator is garbage-collected -- at once in CPython; `await
        it.aclose()` to be explicit)."""
        stream = self.submit(prompt, sampling_params, request_id, priority, output_kind)
        try:
            async for item in stream:
                yield item
        finally:
            stream.close()

    def submit(
        self,
        prompt: str | list[int] | dict[str, Any],
        sampling_params: SamplingParams | None,
        request_id: str,
        priority: int = 0,
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
    ) -> RequestStream:
        """Sends one request to the engine now (generate() sends it at its
        first iteration; a server submits while it still sets up the
        response) and returns its outputs as a RequestStream. Called on the
        event loop the outputs go to. A bad request raises ValueError here,
        a dead engine EngineDeadError."""
        self._raise_if_dead()
        state, core_requests = self.processor.process(request_id, prompt, sampling_params, time.time(), priority,
                                                      output_kind, self.client_index)
        collector = _Collector(output_kind is RequestOutputKind.DELTA)
        with self._lock:
            self._raise_if_dead()
            if request_id in self._collectors:
                raise ValueError(f"request_id {request_id!r} is already in use")
            if not self.output_processor.has_unfinished_requests():
                self._woke = time.monotonic()
            self.output_processor.add_request(state)
            self._collectors[request_id] = (asyncio.get_running_loop(), collector)
        self.client.add_requests(core_requests)
        return RequestStream(self, request_id, collector)

    def abort(self, request_id: str) -> None:
        """Ends a request: its stream's last output has finish_reason
        "abort" and the partial text. A no-op for unknown or finished ids.
        Safe from any thread."""
        self._abort(request_id, notify=True)

    def abort_all(self) -> None:
        """Aborts every request in flight (a server's bounded drain at
        shutdown): each stream ends as abort() ends it."""
        with self._lock:
            request_ids = list(self._collectors)
        for request_id in request_ids:
            self.abort(request_id)

    def _abort(self, request_id: str, notify: bool) -> None:
        with self._lock:
            result = self.output_processor.abort_requests([request_id])
            entry = self._collectors.pop(request_id, None)
        self.client.abort_requests(result.reqs_to_abort)
        self._record(result.stats)
        if notify and entry is not None and result.request_outputs:
            _post(*entry, result.request_outputs[0])

    @property
    def num_waiting_requests(self) -> int:
        """Sequences accepted but not running yet: those the front end has
        sent, less those the core last said run (a snapshot: all admission
        needs)."""
        return max(0, len(self.output_processor.parents) - self.scheduler_stats.num_running)

    @property
    def is_running(self) -> bool:
        return self.client.is_alive() and self._dead is None

    @property
    def errored(self) -> bool:
        return self._dead is not None

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead

    def check_health(self, max_stall: float | None = None) -> None:
        """Raises EngineDeadError when the engine is not serving, and
        EngineStalledError when it has work but has not finished a step for
        more than max_stall seconds (None: no stall check)."""
        self._raise_if_dead()
        if not self.client.is_alive():
            raise EngineDeadError("the engine core is not running")
        if max_stall is not None and self.output_processor.has_unfinished_requests():
            stalled = time.monotonic() - max(self.client.heartbeat, self._woke)
            if stalled > max_stall:
                raise EngineStalledError(
                    f"the engine has not completed a step for {stalled:.1f} s while requests are pending")

    def get_tokenizer(self):
        return self.tokenizer

    async def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix, between the core's steps; False,
        changing nothing, while requests hold KV blocks."""
        self._raise_if_dead()
        try:
            return await asyncio.wrap_future(self.client.call_utility("reset_prefix_cache"))
        except EngineCoreDiedError as exc:
            raise EngineDeadError(f"the engine is dead: {exc}") from exc

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stops the engine core (after its current step); pending streams
        get EngineDeadError. Idempotent."""
        self.client.shutdown(timeout)
        self._on_dead(EngineDeadError("the AsyncLLM was shut down"))

    def __enter__(self) -> AsyncLLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def _raise_if_dead(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine is dead: {self._dead!r}") from self._dead

    # --- the client's thread ------------------------------------------------------

    def _on_outputs(self, outputs: EngineCoreOutputs) -> None:
        self._scheduler_stats = outputs.stats
        posts: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
        with self._lock:
            result: OutputProcessorResult = self.output_processor.process_outputs(outputs.outputs)
            for output in result.request_outputs:
                entry = (self._collectors.pop(output.request_id, None) if output.finished
                         else self._collectors.get(output.request_id))
                if entry is not None:
                    loop, collector = entry
                    posts[loop].append((collector, output if output.error is None else RequestFailedError(output.error)))
        self.client.abort_requests(result.reqs_to_abort)
        self._record(result.stats)
        for loop, batch in posts.items():
            try:
                loop.call_soon_threadsafe(_deliver, batch)
            except RuntimeError:  # its loop is closed: nobody is listening
                for collector, item in batch:
                    if isinstance(item, RequestOutput) and not item.finished:
                        self._abort(item.request_id, notify=False)

    def _on_dead(self, exc: BaseException) -> None:
        with self._lock:
            if self._dead is None:
                self._dead = exc
            entries, self._collectors = list(self._collectors.values()), {}
            self.output_processor.fail_all()
        error = exc if isinstance(exc, EngineDeadError) else EngineDeadError(f"the engine died: {exc}")
        for loop, collector in entries:
            # One exception object per waiter: each raise writes its own traceback.
            waiter_error = EngineDeadError(*error.args)
            waiter_error.__cause__ = None if exc is error else exc
            _post(loop, collector, waiter_error)

    def _record(self, stats: IterationStats) -> None:
        for stat_logger in self.stat_loggers:
            try:
                stat_logger.record(stats)
            except Exception:  # noqa: BLE001 -- a metrics bug must not kill the engine
                logger.exception("stat logger %r failed", stat_logger)


def _shutdown_at_exit(ref: weakref.ref) -> None:
    llm = ref()
    if llm is not None:
        llm.shutdown(timeout=10.0)


def _deliver(batch: list) -> None:
    for collector, item in batch:
        collector.put(item)


def _post(loop: asyncio.AbstractEventLoop, collector: _Collector, item) -> None:
    """Hands an output or an exception to a caller's loop (if it still runs)."""
    try:
        loop.call_soon_threadsafe(collector.put, item)
    except RuntimeError:
        pass


__all__ = ["AsyncLLM", "EngineCoreDiedError", "EngineDeadError", "EngineStalledError", "RequestFailedError",
           "RequestOutputKind"]
