"""AsyncLLM (vLLM's name): the LLMEngine behind an asyncio streaming API, for
servers. `async for output in llm.generate(prompt, params, request_id)` yields
RequestOutputs as tokens arrive; many callers stream concurrently, each
sharing the engine's continuous batching.

Threads. The engine steps in one background thread and only that thread ever
touches the LLMEngine (so the engine needs no locks):
  - a model step is long CPU work (tens of ms to seconds); run on the event
    loop it would freeze every connection for that long. In a thread the loop
    keeps serving, since torch releases the GIL inside its kernels and Python
    switches threads every few ms otherwise. (A separate process, as vLLM v1
    uses, would also isolate the GIL; a thread is enough for this in-process
    engine and keeps outputs as plain objects.)
  - requests and aborts reach the engine thread through a queue.Queue; the
    thread blocks on it when it has no work (no busy spin);
  - outputs go back to each caller's event loop with loop.call_soon_threadsafe
    into that request's asyncio.Queue.
A request that fails inside a step fails alone: its caller gets
RequestFailedError and the engine serves on. If the engine itself raises,
every waiter gets EngineDeadError (not a hang) and later calls fail at once. The thread also keeps a heartbeat (when it last finished a
step while busy), so check_health() can tell a stalled engine from a busy one.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, AsyncIterator

from pagoda.engine.arg_utils import EngineArgs
from pagoda.engine.llm_engine import LLMEngine
from pagoda.logger import init_logger
from pagoda.metrics import StatLogger
from pagoda.outputs import CompletionOutput, RequestOutput, RequestOutputKind  # noqa: F401 -- re-exported
from pagoda.sampling_params import SamplingParams

logger = init_logger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop stopped (an exception in a step, or shutdown()); the
    AsyncLLM must be recreated. __cause__ holds the original exception."""


class RequestFailedError(RuntimeError):
    """This request failed inside an engine step (RequestOutput.error says
    how); the engine freed its blocks and serves every other request on."""


class EngineStalledError(RuntimeError):
    """The engine loop is alive and has work but has not finished a step for
    longer than the caller allows (a hung kernel, a deadlock)."""


@dataclass
class _Add:
    request_id: str
    prompt: Any
    params: SamplingParams | None
    priority: int
    stream: _Stream  # the caller waiting for it (an id may be reused after an abort)
    arrival_time: float  # time.time() when the caller asked: queue time includes waiting for the engine thread


@dataclass
class _Abort:
    request_id: str
    stream: _Stream | None = None  # set when the caller itself went away (its stream is already closed)


_STOP = object()  # tells the engine thread to exit


@dataclass
class _Stream:
    """Where a request's outputs go: its caller's loop and queue."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue  # RequestOutput, or an exception to raise in the caller


class AsyncLLM:
    """AsyncLLM(model, **engine_args) with LLM's arguments (EngineArgs), or
    AsyncLLM.from_engine(engine) around an existing LLMEngine. Stats logging
    is on by default (disable_log_stats=True turns it off).

    stat_loggers: objects with record(outputs: list[RequestOutput]), called in
    the engine thread with every step's outputs and with the final output of
    each aborted request (e.g. the server's PrometheusStatLogger)."""

    def __init__(self, model: str, disable_log_stats: bool = False, stats_interval: float = 10.0, **engine_args):
        args = EngineArgs(model=model, disable_log_stats=disable_log_stats, stats_interval=stats_interval, **engine_args)
        self._start(args.create_engine())

    @classmethod
    def from_engine(
        cls, engine: LLMEngine, disable_log_stats: bool = False, stats_interval: float = 10.0
    ) -> AsyncLLM:
        self = cls.__new__(cls)
        if not disable_log_stats and engine.stat_logger is None:
            engine.stat_logger = StatLogger(engine, stats_interval)
        self._start(engine)
        return self

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> AsyncLLM:
        return cls.from_engine(args.create_engine(), disable_log_stats=True)  # args decided stats logging

    def _start(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_config = engine.model_config
        self._commands: queue.Queue = queue.Queue()
        # Guards _streams and _dead: a generate() that registers a stream and
        # the engine thread that fails all streams see each other's changes.
        self._lock = threading.Lock()
        self._streams: dict[str, _Stream] = {}
        self._dead: BaseException | None = None
        self.stat_loggers: list = []
        # Written by the engine thread only: busy = it has work (not blocked
        # waiting for a command); heartbeat = time.monotonic() it last woke up
        # or finished a step.
        self._busy = False
        self._heartbeat = time.monotonic()
        self._thread = threading.Thread(target=self._engine_loop, name="pagoda-engine", daemon=True)
        self._thread.start()

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
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            self._raise_if_dead()
            if request_id in self._streams:
                raise ValueError(f"request_id {request_id!r} is already in use")
            self._streams[request_id] = stream
        self._commands.put(_Add(request_id, prompt, sampling_params, priority, stream, time.time()))
        finished = False
        sent_by_index: dict[int, CompletionOutput] = {}
        try:
            while not finished:
                item = await stream.queue.get()
                # Outputs are cumulative, so when the caller fell behind only
                # the newest matters (deltas are computed from what was sent).
                while not stream.queue.empty() and not isinstance(item, BaseException):
                    item = stream.queue.get_nowait()
                if isinstance(item, BaseException):
                    finished = True  # the engine already dropped the request
                    raise item
                finished = item.finished
                if output_kind is RequestOutputKind.FINAL_ONLY and not finished:
                    continue
                if output_kind is RequestOutputKind.DELTA:
                    deltas = [_delta(c, sent_by_index.get(c.index)) for c in item.outputs]
                    sent_by_index = {c.index: c for c in item.outputs}
                    item = replace(item, outputs=deltas)
                yield item
        finally:
            if not finished:  # cancelled or abandoned: free its KV blocks
                with self._lock:
                    if self._streams.get(request_id) is stream:
                        del self._streams[request_id]
                self._commands.put(_Abort(request_id, stream))

    def abort(self, request_id: str) -> None:
        """Ends a request: its stream's last output has finish_reason
        "abort" and the partial text. A no-op for unknown or finished ids.
        Safe from any thread."""
        self._commands.put(_Abort(request_id))

    def abort_all(self) -> None:
        """Aborts every request in flight (a server's bounded drain at
        shutdown): each stream ends as abort() ends it."""
        with self._lock:
            request_ids = list(self._streams)
        for request_id in request_ids:
            self.abort(request_id)

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._dead is None

    @property
    def errored(self) -> bool:
        return self._dead is not None

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead

    def check_health(self, max_stall: float | None = None) -> None:
        """Raises EngineDeadError when the engine loop is not serving, and
        EngineStalledError when it has work but has not finished a step for
        more than max_stall seconds (None: no stall check)."""
        with self._lock:
            self._raise_if_dead()
        if not self._thread.is_alive():
            raise EngineDeadError("the engine thread is not running")
        if max_stall is not None and self._busy:
            stalled = time.monotonic() - self._heartbeat
            if stalled > max_stall:
                raise EngineStalledError(
                    f"the engine has not completed a step for {stalled:.1f} s while requests are pending")

    def get_tokenizer(self):
        return self.tokenizer

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stops the engine thread (after its current step); pending streams
        get EngineDeadError. Idempotent."""
        self._commands.put(_STOP)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        self._fail_all(EngineDeadError("the AsyncLLM was shut down"))

    def __enter__(self) -> AsyncLLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def _raise_if_dead(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine is dead: {self._dead!r}") from self._dead

    # --- the engine thread ------------------------------------------------------

    def _engine_loop(self) -> None:
        engine = self.engine
        try:
            while True:
                # Block only when idle; with work in flight just drain what came in.
                if engine.has_unfinished_requests():
                    command = self._next_command()
                else:
                    self._busy = False
                    command = self._commands.get()
                    # Heartbeat before busy: no reader sees busy with an idle-time heartbeat.
                    self._heartbeat = time.monotonic()
                    self._busy = True
                while command is not None:
                    if command is _STOP:
                        return
                    self._apply(command)
                    command = self._next_command()
                if engine.has_unfinished_requests():
                    self._deliver(engine.step())
                    self._heartbeat = time.monotonic()
        except BaseException as exc:  # noqa: BLE001 -- any failure must reach the waiters
            logger.exception("the engine loop failed; failing every request")
            self._fail_all(EngineDeadError(f"the engine loop failed: {exc!r}"), cause=exc)

    def _next_command(self):
        try:
            return self._commands.get_nowait()
        except queue.Empty:
            return None

    def _apply(self, command) -> None:
        if isinstance(command, _Abort):
            self._abort(command)
            return
        stream = command.stream
        with self._lock:
            if self._streams.get(command.request_id) is not stream:
                return  # aborted before it reached the engine
        try:
            self.engine.add_request(command.request_id, command.prompt, command.params,
                                    arrival_time=command.arrival_time, priority=command.priority)
        except Exception as exc:  # a bad request fails its caller, not the engine
            with self._lock:
                self._streams.pop(command.request_id, None)
            _post(stream, exc)

    def _abort(self, command: _Abort) -> None:
        output = self._abort_in_engine(command.request_id)
        if command.stream is not None:
            return  # the caller is gone: nobody to tell
        with self._lock:
            stream = self._streams.pop(command.request_id, None)
        if stream is not None:
            # Its final output (finished, "abort"). None: the abort overtook
            # the request's own _Add (sent from another thread).
            _post(stream, output if output is not None else
                  RuntimeError(f"request {command.request_id!r} was aborted before it started"))

    def _abort_in_engine(self, request_id: str) -> RequestOutput | None:
        """Aborts in the engine; returns the request's final output (None if
        the engine does not know it), which the stat loggers see too."""
        state = self.engine.states.get(request_id)
        self.engine.abort_request(request_id)
        if state is None:
            return None
        output = state.output()
        self._record([output])
        return output

    def _record(self, outputs: list[RequestOutput]) -> None:
        for stat_logger in self.stat_loggers:
            try:
                stat_logger.record(outputs)
            except Exception:  # noqa: BLE001 -- a metrics bug must not kill the engine
                logger.exception("stat logger %r failed", stat_logger)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        self._record(outputs)
        for output in outputs:
            for completion in output.outputs:
                if completion.logprobs is not None:
                    # The detokenizer keeps appending to this list in this thread.
                    completion.logprobs = list(completion.logprobs)
            with self._lock:
                # A caller that left just now has removed its stream itself.
                stream = (self._streams.pop(output.request_id, None) if output.finished
                          else self._streams.get(output.request_id))
            if stream is not None and output.error is not None:
                _post(stream, RequestFailedError(output.error))
            elif stream is not None and not _post(stream, output):
                self._abort_in_engine(output.request_id)  # its loop is gone

    def _fail_all(self, error: EngineDeadError, cause: BaseException | None = None) -> None:
        with self._lock:
            if self._dead is None:
                self._dead = cause or error
            streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            # One exception object per waiter: each raise writes its own traceback.
            waiter_error = EngineDeadError(*error.args)
            waiter_error.__cause__ = cause
            _post(stream, waiter_error)


def _post(stream: _Stream, item) -> bool:
    """Hands an output or an exception to a caller's loop; False if that loop is closed."""
    try:
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
        return True
    except RuntimeError:
        return False


def _delta(current: CompletionOutput, previous: CompletionOutput | None) -> CompletionOutput:
    """What `current` adds to `previous` (both cumulative; text only grows)."""
    if previous is None:
        return current
    logprobs = current.logprobs
    if logprobs is not None and previous.logprobs is not None:
        logprobs = logprobs[len(previous.logprobs):]
    return replace(
        current,
        text=current.text[len(previous.text):],
        token_ids=current.token_ids[len(previous.token_ids):],
        logprobs=logprobs,
    )
