"""The engine-core process (vLLM v1's EngineCoreProc): an EngineCore behind
ZeroMQ sockets, so that the model steps in an interpreter of its own and the
GIL never makes the GPU wait for HTTP, tokenization or streaming.

Channel: the core binds one PULL socket that every front end (API server
process) pushes requests to; each front end binds a PULL socket of its own
and announces it with HELLO, and the core pushes that front end's outputs
there -- one message per step, every sequence's new token ids in it, with
the scheduler's stats. Frames are [RequestType, msgpack payload]
(core_messages). A UTILITY call (core.UTILITY_METHODS: reset_prefix_cache)
runs between steps and is answered on its caller's socket. A receiver thread takes messages off the input socket and
decodes them as they come (while the loop waits on the device), and the
loop applies, between steps, those that had arrived when its pass began:
a steady inflow of requests cannot keep it from stepping, decoding (about
0.2 ms a request, mostly re-validating its SamplingParams) overlaps the
device's work, and the socket never fills up to its high-water mark.

Lifetime: the process ignores SIGINT/SIGTERM (a Ctrl-C or a supervisor's
SIGTERM reaches the whole process group, and the API server drains before
it stops the core with SHUTDOWN), and exits at once if its parent dies, so
it never outlives the server. A step that fails for a reason no request
explains sends DEAD with the reason to every front end and exits 1."""

from __future__ import annotations

import gc
import multiprocessing.connection
import queue
import signal
import threading

import zmq

from pagoda.engine.arg_utils import EngineArgs
from pagoda.engine.core import EngineCore
from pagoda.engine.core_messages import (DECODERS, ENCODER, EngineCoreOutput, EngineCoreOutputs, RequestType,
                                         UtilityCall, UtilityResult)
from pagoda.logger import init_logger, tag_process_logs
from pagoda.process_watch import exit_with_parent

logger = init_logger(__name__)


def run_engine_core(args: EngineArgs, input_address: str, startup: multiprocessing.connection.Connection) -> None:
    """The process's entry point (multiprocessing, spawned, see CoreStart):
    builds its configs, takes the front end's stop ids from `startup` (sent
    once the front end has its tokenizer: meanwhile both import and read
    configs), builds the core, reports ("ready", EngineCoreReady) or
    ("error", type name, message) through `startup`, then serves until
    SHUTDOWN."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    tag_process_logs()
    exit_with_parent()
    try:
        configs = args.create_engine_configs()
        core = EngineCore(*configs, startup.recv())
        if not args.disable_log_stats:
            from pagoda.metrics import StatLogger

            core.stat_logger = StatLogger(args.stats_interval)
        proc = EngineCoreProc(core, input_address)
    except BaseException as exc:  # noqa: BLE001 -- reported to the parent, which raises it
        try:
            startup.send(("error", type(exc).__name__, str(exc)))
        except OSError:  # the front end gave up its start (CoreStart.cancel)
            pass
        raise SystemExit(1) from None
    # The start-up's objects (modules, parameters, the cache's blocks) live as
    # long as the process: frozen, no full collection walks them while serving.
    gc.collect()
    gc.freeze()
    startup.send(("ready", core.ready_message()))
    startup.close()
    raise SystemExit(proc.run())




class EngineCoreProc:
    def __init__(self, core: EngineCore, input_address: str):
        self.core = core
        self.context = zmq.Context()
        self.input = self.context.socket(zmq.PULL)  # the receiver thread's alone once run() starts
        self.input.bind(input_address)
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()  # (RequestType, decoded payload), or (None, an error)
        self.receiver = threading.Thread(target=self._take_input, name="pagoda-core-input", daemon=True)
        self.clients: dict[int, zmq.Socket] = {}  # client index -> its output socket
        self.client_of: dict[str, int] = {}  # live sequence id -> its client index
        self.refused: list[tuple[int, EngineCoreOutput]] = []  # (client index, its failed add), for the next send
        self.stopping = False

    def run(self) -> int:
        """The busy loop; returns the exit status."""
        core = self.core
        self.receiver.start()
        try:
            while not self.stopping:
                handled = self._receive(block=not core.has_unfinished_requests())
                if self.stopping:
                    break
                if core.has_unfinished_requests():
                    self._send(core.step())
                elif handled:
                    self._send([])  # stats after aborts or failed adds: gauges stay current
        except BaseException as exc:  # noqa: BLE001 -- every front end must hear of it
            logger.exception("the engine core failed; it stops")
            self._broadcast(RequestType.DEAD, ENCODER.encode(f"{type(exc).__name__}: {exc}"))
            return 1
        finally:
            self._close()
            self.core.shutdown()
        return 0

    def _take_input(self) -> None:
        """The receiver thread, until the context is terminated: every
        message decoded into the inbox; a failure goes there too, for the
        loop to raise."""
        try:
            while True:
                kind, payload = self.input.recv_multipart(copy=False)
                kind = RequestType(kind.bytes)
                self.inbox.put((kind, DECODERS[kind].decode(payload.buffer) if kind in DECODERS else None))
        except zmq.ContextTerminated:
            self.input.close(linger=0)
        except BaseException as exc:  # noqa: BLE001 -- the loop raises it: the engine core stops
            self.inbox.put((None, exc))

    def _receive(self, block: bool) -> bool:
        """Applies the messages in the inbox when this pass began (after
        waiting for one when `block` and there is none); whether there were any."""
        handled = False
        if block and self.inbox.empty():
            self._apply(*self.inbox.get())
            handled = True
        for _ in range(self.inbox.qsize()):  # counted once: what arrives meanwhile waits for the next pass
            if self.stopping:
                break
            self._apply(*self.inbox.get_nowait())
            handled = True
        return handled

    def _apply(self, kind: RequestType | None, payload) -> None:
        if kind is None:
            raise payload  # the receiver thread failed
        if kind is RequestType.ADD:
            request = payload
            try:
                self.core.add_request(request)
            except ValueError as exc:  # checked by the front end; a clash of ids still fails the one request
                self.refused.append((request.client_index,
                                     EngineCoreOutput(request.request_id, [], "error", error=str(exc))))
            else:
                self.client_of[request.request_id] = request.client_index
        elif kind is RequestType.ABORT:
            request_ids = payload
            self.core.abort_requests(request_ids)
            for request_id in request_ids:
                self.client_of.pop(request_id, None)
        elif kind is RequestType.HELLO:
            index, address = payload
            socket = self.context.socket(zmq.PUSH)
            socket.connect(address)
            self.clients[index] = socket
            socket.send_multipart([RequestType.READY.value, ENCODER.encode(self.core.ready_message())])
        elif kind is RequestType.UTILITY:
            self._call_utility(payload)
        elif kind is RequestType.SHUTDOWN:
            self.stopping = True

    def _call_utility(self, call: UtilityCall) -> None:
        """Runs the call and answers its caller; a call that raises fails alone."""
        try:
            result = UtilityResult(call.call_id, self.core.call_utility(call.method, tuple(call.args)))
        except Exception as exc:  # noqa: BLE001 -- the caller gets it, the core serves on
            result = UtilityResult(call.call_id, error_type=type(exc).__name__, error=str(exc))
        socket = self.clients.get(call.client_index)
        if socket is not None:
            socket.send_multipart([RequestType.UTILITY_RESULT.value, ENCODER.encode(result)])

    def _send(self, outputs: list[EngineCoreOutput]) -> None:
        """One message per front end: its sequences' outputs and the stats."""
        by_client: dict[int, list[EngineCoreOutput]] = {index: [] for index in self.clients}
        for output in outputs:
            index = self.client_of.pop(output.request_id) if output.finished else self.client_of.get(output.request_id)
            if index in by_client:
                by_client[index].append(output)
        for index, output in self.refused:
            if index in by_client:
                by_client[index].append(output)
        self.refused = []
        stats = self.core.stats()
        for index, client_outputs in by_client.items():
            message = EngineCoreOutputs(client_outputs, stats)
            self.clients[index].send_multipart([RequestType.OUTPUTS.value, ENCODER.encode(message)], copy=False)

    def _broadcast(self, kind: RequestType, payload: bytes) -> None:
        for socket in self.clients.values():
            socket.send_multipart([kind.value, payload])

    def _close(self) -> None:
        # Linger: what was sent last (DEAD, the final outputs) still goes out.
        for socket in self.clients.values():
            socket.close(linger=2000)
        if not self.receiver.is_alive():  # it closes the input socket itself when the context ends
            self.input.close(linger=0)
        self.context.term()
        self.receiver.join(timeout=5)
