"""How a front end reaches an engine core. AsyncLLM's: in this process, on a
thread (InprocClient), or in an engine-core process over ZeroMQ (MPClient).
Both take requests and aborts from any thread and, once started, call
`on_outputs` with each step's EngineCoreOutputs, and `on_dead` once if the
core dies, on a thread of their own. The offline LLMEngine's, with its core
in a process: SyncMPClient, an MPClient whose outputs wait in a queue for
the engine's step() (with its core here: llm_engine.SyncInprocClient)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import multiprocessing
import os
import queue
import shutil
import tempfile
import threading
import time
from typing import Callable

import zmq

from pagoda.engine.arg_utils import EngineArgs
from pagoda.engine.core import EngineCore
from pagoda.engine.core_messages import (DECODERS, ENCODER, EngineCoreOutput, EngineCoreOutputs, EngineCoreReady,
                                         EngineCoreRequest, RequestType, UtilityCall, UtilityResult)
from pagoda.logger import init_logger
from pagoda.process_watch import raise_startup_error, reported_error, spawn

logger = init_logger(__name__)

OnOutputs = Callable[[EngineCoreOutputs], None]
OnDead = Callable[[BaseException], None]
STARTUP_POLL_S = 0.5  # how often start-up checks that the core process still lives


class EngineCoreDiedError(RuntimeError):
    """The engine core stopped: a fault no request explains, or its process ended."""


def utility_outcome(future: concurrent.futures.Future, method: str, result: UtilityResult) -> None:
    """Settles a utility call's future with what the core answered: its
    result, or what it raised, as a ValueError or TypeError where it is one
    (the caller's arguments), else a RuntimeError naming it."""
    if result.error_type is None:
        future.set_result(result.result)
        return
    future.set_exception(reported_error(result.error_type, result.error, (ValueError, TypeError)) or RuntimeError(
        f"the engine core's {method} failed: {result.error_type}: {result.error}"))


class InprocClient:
    """The core steps in a background thread of this process: the thread
    alone touches it (no locks), blocks on its command queue when idle and
    keeps a heartbeat (when it last finished a step)."""

    _STOP = object()

    def __init__(self, core: EngineCore, on_outputs: OnOutputs, on_dead: OnDead):
        self.core = core
        self.ready = core.ready_message()
        self.on_outputs, self.on_dead = on_outputs, on_dead
        self._commands: queue.Queue = queue.Queue()
        self._closed_lock = threading.Lock()
        self._closed = False  # the loop ended: a command put now would never be read
        self.heartbeat = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="pagoda-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        self._commands.put((RequestType.ADD, requests))

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self._commands.put((RequestType.ABORT, request_ids))

    def call_utility(self, method: str, *args) -> concurrent.futures.Future:
        """Runs core.UTILITY_METHODS' `method` on the loop's thread between
        steps; the future holds its result or what it raised
        (EngineCoreDiedError once the loop has ended)."""
        future = concurrent.futures.Future()
        with self._closed_lock:
            if self._closed:
                future.set_exception(EngineCoreDiedError("the engine loop has stopped"))
            else:
                self._commands.put((RequestType.UTILITY, (future, method, args)))
        return future

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def shutdown(self, timeout: float | None = 30.0) -> None:
        self._commands.put(self._STOP)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _run(self) -> None:
        core = self.core
        try:
            while True:
                # Block only when idle; with work in flight just drain what came in.
                command = self._next_command() if core.has_unfinished_requests() else self._commands.get()
                handled = False
                while command is not None:
                    if command is self._STOP:
                        return
                    self._apply(*command)
                    handled, command = True, self._next_command()
                if core.has_unfinished_requests():
                    self.on_outputs(EngineCoreOutputs(core.step(), core.stats()))
                    self.heartbeat = time.monotonic()
                elif handled:
                    self.on_outputs(EngineCoreOutputs([], core.stats()))
        except BaseException as exc:  # noqa: BLE001 -- any failure must reach the waiters
            logger.exception("the engine loop failed; failing every request")
            self.on_dead(exc)
        finally:
            with self._closed_lock:
                self._closed = True
            while (command := self._next_command()) is not None:
                if command is not self._STOP and command[0] is RequestType.UTILITY:
                    command[1][0].set_exception(EngineCoreDiedError("the engine loop has stopped"))
            core.shutdown()

    def _next_command(self):
        try:
            return self._commands.get_nowait()
        except queue.Empty:
            return None

    def _apply(self, kind: RequestType, payload) -> None:
        if kind is RequestType.ADD:
            self.core.add_requests(payload)
        elif kind is RequestType.ABORT:
            self.core.abort_requests(payload)
        else:
            future, method, args = payload
            try:
                future.set_result(self.core.call_utility(method, args))
            except Exception as exc:  # noqa: BLE001 -- the caller gets it, the loop serves on
                future.set_exception(exc)


class CoreStart:
    """An engine-core process spawned before the front end loads its own
    config and tokenizer: the core needs the front end's stop ids only once
    its imports and configs are done (seconds: torch, transformers), so the
    front end's start overlaps the core's instead of preceding it. The front
    end starts inside cancelled_on_failure(); finish() sends the ids and
    waits until the model is loaded."""

    def __init__(self, args: EngineArgs):
        from pagoda.engine.core_proc import run_engine_core

        self.socket_dir = tempfile.mkdtemp(prefix="pagoda-")
        self.address = f"ipc://{self.socket_dir}/core-input"
        context = multiprocessing.get_context("spawn")  # CUDA cannot be forked
        # Duplex: the stop ids go in, the start's outcome comes back.
        self._pipe, theirs = context.Pipe()
        self.process = context.Process(target=run_engine_core, args=(args, self.address, theirs),
                                       # not daemonic: it spawns the worker processes of an mp executor
                                       name="pagoda-engine-core")
        spawn(self.process)
        theirs.close()

    def finish(self, eos_token_ids: list[int]) -> tuple[multiprocessing.Process, str, str]:
        """Returns (the process, its input address, the folder of its
        sockets, to remove at the end) once the model is loaded. A core that
        cannot start raises here as it would in process: ValueError or
        OSError for bad flags and model files."""
        try:
            self._pipe.send(list(eos_token_ids))
        except OSError:  # the core has already failed; its message waits in the pipe
            pass
        try:
            while not self._pipe.poll(STARTUP_POLL_S):
                if not self.process.is_alive():
                    raise EngineCoreDiedError(
                        f"the engine core process exited with status {self.process.exitcode} while starting")
            message = self._pipe.recv()
        except BaseException:
            self.cancel()
            raise
        self._pipe.close()
        if message[0] == "error":
            self.process.join()
            shutil.rmtree(self.socket_dir, ignore_errors=True)
            _, kind, text = message
            raise_startup_error(kind, text, EngineCoreDiedError, "the engine core")
        logger.info("engine core process %d ready", self.process.pid)
        return self.process, self.address, self.socket_dir

    @contextlib.contextmanager
    def cancelled_on_failure(self):
        """The front end's own start: if it raises, the core is stopped
        (cancel) before the error goes on."""
        try:
            yield
        except BaseException:
            self.cancel()
            raise

    def cancel(self) -> None:
        """Stops the process (it has bound nothing yet) and removes its folder."""
        self._pipe.close()
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5)
        shutil.rmtree(self.socket_dir, ignore_errors=True)


def stop_engine_core(process: multiprocessing.Process, address: str, socket_dir: str,
                     timeout: float | None = 30.0) -> None:
    """Asks an engine-core process to stop (after its current step), waits
    for it, kills it past `timeout`, and removes its sockets' folder."""
    if process.is_alive():
        context = zmq.Context()
        sock = context.socket(zmq.PUSH)
        sock.connect(address)
        sock.send_multipart([RequestType.SHUTDOWN.value, b""])
        sock.close(linger=1000)
        context.term()
        process.join(timeout)
        if process.is_alive():
            logger.warning("the engine core did not stop in %s s: killing it", timeout)
            process.kill()
            process.join(5)
    shutil.rmtree(socket_dir, ignore_errors=True)


class MPClient:
    """A front end of an engine-core process. Requests go out on a PUSH
    socket (any thread; a lock keeps sends whole); outputs come in on this
    client's own PULL socket, read by a thread that also watches the core
    process, so a core that dies without a word (killed, crashed) is
    noticed within a poll interval.

    process/socket_dir: given when this client owns the core (started it
    with CoreStart): its shutdown then stops the core. Several
    clients (API server processes) may share one core, each with its own
    client_index."""

    POLL_MS = 1000  # how often the output thread checks the core process when no message comes

    def __init__(self, input_address: str, on_outputs: OnOutputs, on_dead: OnDead, client_index: int = 0,
                 core_pid: int | None = None, process: multiprocessing.Process | None = None,
                 socket_dir: str | None = None):
        self.on_outputs, self.on_dead = on_outputs, on_dead
        self.client_index = client_index
        self.address, self.process, self.socket_dir = input_address, process, socket_dir
        self.core_pid = process.pid if process is not None else core_pid
        self._own_dir = tempfile.mkdtemp(prefix="pagoda-client-")
        output_address = f"ipc://{self._own_dir}/outputs"
        self.context = zmq.Context()
        self.output = self.context.socket(zmq.PULL)
        self.output.bind(output_address)
        self.input = self.context.socket(zmq.PUSH)
        self.input.connect(input_address)
        self._send_lock = threading.Lock()
        self._closing = False
        self._gone: BaseException | None = None  # why outputs stopped; set under _send_lock
        self._calls: dict[int, tuple[concurrent.futures.Future, str]] = {}  # utility calls awaiting a result
        self._call_ids = itertools.count()
        self.heartbeat = time.monotonic()
        self._send(RequestType.HELLO, ENCODER.encode((client_index, output_address)))
        kind, payload = self._recv_ready()
        self.ready: EngineCoreReady = DECODERS[RequestType.READY].decode(payload)
        self._thread = threading.Thread(target=self._run, name="pagoda-core-outputs", daemon=True)

    def start(self) -> None:
        """Starts delivering outputs (to on_outputs, on its thread)."""
        self._thread.start()

    def _recv_ready(self):
        while not self.output.poll(self.POLL_MS):
            if not self._core_alive():
                raise EngineCoreDiedError("the engine core process is gone (no answer to HELLO)")
        return self.output.recv_multipart()

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        for request in requests:
            self._send(RequestType.ADD, ENCODER.encode(request))

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self._send(RequestType.ABORT, ENCODER.encode(request_ids))

    def call_utility(self, method: str, *args) -> concurrent.futures.Future:
        """Calls core.UTILITY_METHODS' `method` between the core's steps; the
        future holds its result or what it raised (utility_outcome), or
        EngineCoreDiedError once the core is gone or this client shut down."""
        future = concurrent.futures.Future()
        with self._send_lock:
            if self._closing or self._gone is not None:
                future.set_exception(EngineCoreDiedError(f"the engine core is gone: {self._gone or 'shut down'}"))
                return future
            call_id = next(self._call_ids)
            self._calls[call_id] = (future, method)
            call = UtilityCall(self.client_index, call_id, method, list(args))
            self.input.send_multipart([RequestType.UTILITY.value, ENCODER.encode(call)])
        return future

    def _fail_calls(self, reason: BaseException) -> None:
        """No result will come: every pending utility call fails, and later ones at once."""
        with self._send_lock:
            self._gone = self._gone or reason
            calls, self._calls = self._calls, {}
        for future, _ in calls.values():
            future.set_exception(EngineCoreDiedError(f"the engine core is gone: {reason}"))

    def _send(self, kind: RequestType, payload: bytes) -> None:
        with self._send_lock:
            if not self._closing:
                self.input.send_multipart([kind.value, payload])

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def _core_alive(self) -> bool:
        if self.process is not None:
            return self.process.is_alive()
        try:
            os.kill(self.core_pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        # A zombie (its parent has not reaped it yet) is dead too.
        try:
            with open(f"/proc/{self.core_pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return True

    def _run(self) -> None:
        decode_outputs = DECODERS[RequestType.OUTPUTS]
        try:
            while not self._closing:
                if not self.output.poll(self.POLL_MS):
                    if not self._closing and not self._core_alive():
                        code = self.process.exitcode if self.process is not None else None
                        raise EngineCoreDiedError(f"the engine core process exited (status {code})")
                    continue
                kind, payload = self.output.recv_multipart(copy=False)
                kind = RequestType(kind.bytes)
                if kind is RequestType.OUTPUTS:
                    self.heartbeat = time.monotonic()
                    self.on_outputs(decode_outputs.decode(payload.buffer))
                elif kind is RequestType.UTILITY_RESULT:
                    result = DECODERS[kind].decode(payload.buffer)
                    with self._send_lock:
                        call = self._calls.pop(result.call_id, None)
                    if call is not None:
                        utility_outcome(*call, result)
                elif kind is RequestType.DEAD:
                    raise EngineCoreDiedError(f"the engine core failed: {DECODERS[kind].decode(payload.buffer)}")
        except BaseException as exc:  # noqa: BLE001 -- any failure must reach the waiters
            self._fail_calls(exc)
            if not self._closing:
                logger.error("the engine core is gone: %s; failing every request", exc)
                self.on_dead(exc)

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stops reading outputs; stops the core if this client owns it. Idempotent."""
        with self._send_lock:
            if self._closing:
                return
            self._closing = True
        if self.process is not None:
            stop_engine_core(self.process, self.address, self.socket_dir, timeout)
        if threading.current_thread() is not self._thread:
            self._thread.join(self.POLL_MS / 1000 + 1)
        self._fail_calls(EngineCoreDiedError("the client shut down"))
        self.input.close(linger=0)
        self.output.close(linger=0)
        self.context.term()
        shutil.rmtree(self._own_dir, ignore_errors=True)


class SyncMPClient:
    """An engine-core process started for one synchronous front end (the
    offline LLMEngine): the core steps on its own while the front end
    detokenizes, and get_outputs() returns what it sent since the last call,
    waiting for a step's message when none is there."""

    def __init__(self, start: CoreStart, eos_token_ids: list[int]):
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # EngineCoreOutputs, or the exception that ended the core
        self._dead: BaseException | None = None
        process, address, socket_dir = start.finish(eos_token_ids)
        try:
            self._client = MPClient(address, self._inbox.put, self._inbox.put, process=process, socket_dir=socket_dir)
        except BaseException:
            stop_engine_core(process, address, socket_dir, timeout=5.0)
            raise
        self.ready: EngineCoreReady = self._client.ready
        self.core_pid = self._client.core_pid
        self._client.start()

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        self._client.add_requests(requests)

    def abort_requests(self, request_ids: list[str]) -> None:
        self._client.abort_requests(request_ids)

    def call_utility(self, method: str, *args):
        """core.UTILITY_METHODS' `method`'s result, once the core has run it."""
        return self._client.call_utility(method, *args).result()

    def get_outputs(self) -> list[EngineCoreOutput]:
        """Every sequence output of the steps that arrived (at least one);
        EngineCoreDiedError once the core is gone."""
        if self._dead is None:
            items = [self._inbox.get()]
            while not self._inbox.empty():
                items.append(self._inbox.get_nowait())
            outputs = []
            for item in items:
                if isinstance(item, BaseException):
                    self._dead = item
                    break
                outputs += item.outputs
            else:
                return outputs
        raise EngineCoreDiedError(f"the engine core is gone: {self._dead}") from self._dead

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stops the core process. Idempotent."""
        self._client.shutdown(timeout)
