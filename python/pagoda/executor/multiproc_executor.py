"""The multi-process executor: one spawned process per tensor-parallel rank,
each a Worker on its own device, joined by torch.distributed (NCCL on GPUs,
gloo on the CPU) for the model's collectives.

Each step the scheduler output is pickled once and written to every rank's
pipe; the ranks follow the step protocol of pagoda.executor.ranks (rank 0
sends each result back once the next step is queued, or when asked to flush).

A rank that raises sends its error and exits; one that dies is seen through
its process sentinel. Either way the step in wait raises WorkerDiedError:
the engine fails fast with the rank and the reason, nothing waits forever.
The workers end with the engine (shutdown), with the process that spawned
them (a watch on the parent), or when their pipe closes.
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.connection
import pickle
import signal
import time

from pagoda.executor.ranks import RankedExecutor, RankSteps, WorkerDiedError, free_port, start_worker
from pagoda.logger import init_logger, tag_process_logs
from pagoda.outputs import ModelRunnerOutput
from pagoda.process_watch import exit_with_parent, raise_startup_error, spawn

logger = init_logger(__name__)

SHUTDOWN_TIMEOUT_S = 5.0  # a rank that has not exited by then is killed


class MultiprocExecutor(RankedExecutor):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        world_size = self.parallel_config.world_size
        context = multiprocessing.get_context("spawn")  # CUDA cannot be forked
        init_method = f"tcp://127.0.0.1:{free_port()}"
        self.processes: list[multiprocessing.Process] = []
        self.pipes: list[multiprocessing.connection.Connection] = []
        self._started = False  # startup errors are the caller's to raise (bad flags, files)
        started = time.perf_counter()
        try:
            for rank in range(world_size):
                ours, theirs = context.Pipe()
                process = context.Process(
                    target=run_worker, name=f"pagoda-worker-{rank}", daemon=True,
                    args=(rank, world_size, init_method, self.model_config, self.cache_config,
                          self.scheduler_config, self.eos_token_ids, theirs),
                )
                spawn(process)
                theirs.close()
                self.processes.append(process)
                self.pipes.append(ours)
            blocks = [self._startup_reply(rank) for rank in range(world_size)]
            self._started = True
        except BaseException:
            self.shutdown()
            raise
        # Ranks size their caches alike; the scheduler uses what every one holds.
        self.num_blocks = min(blocks)
        atexit.register(self.shutdown)  # an offline LLM that is never shut down still stops its workers
        logger.info("%d worker process(es) ready in %.1f s (pids %s)", world_size, time.perf_counter() - started,
                    ", ".join(str(p.pid) for p in self.processes))

    def _startup_reply(self, rank: int) -> int:
        message = self._wait(rank, others_send_errors_only=False)  # the others send their own replies
        if message[0] == "error":
            _, kind, text = message
            raise_startup_error(kind, text, WorkerDiedError, f"worker rank {rank}")
        return message[1]

    def _wait(self, rank: int, others_send_errors_only: bool = True):
        """The next message from a rank, watching every rank: an error sent
        by any, or any rank's exit, raises WorkerDiedError."""
        watched = {self.pipes[rank]: rank}
        if others_send_errors_only:
            watched.update({pipe: r for r, pipe in enumerate(self.pipes) if r != rank})
        sentinels = {p.sentinel: r for r, p in enumerate(self.processes)}
        while True:
            for ready in multiprocessing.connection.wait([*watched, *sentinels]):
                if ready in sentinels:
                    pipe = self.pipes[sentinels[ready]]
                    if pipe not in watched or not pipe.poll():  # what it sent before exiting goes first
                        self._raise_dead(sentinels[ready])
                    ready = pipe
                try:
                    message = pickle.loads(ready.recv_bytes())
                except (EOFError, OSError):
                    continue  # its sentinel says how it ended
                if message[0] == "error" and (rank != watched[ready] or self._started):
                    # A rank that lost a peer fails too: name the peer that died first.
                    for r, process in enumerate(self.processes):
                        if not process.is_alive():
                            self._raise_dead(r)
                    raise WorkerDiedError(f"worker rank {watched[ready]} failed: {message[1]}: {message[2]}")
                return message

    def _raise_dead(self, rank: int) -> None:
        process = self.processes[rank]
        process.join()
        raise WorkerDiedError(f"worker rank {rank} (pid {process.pid}) exited with status {process.exitcode}")

    def _send(self, message: tuple) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        for rank, pipe in enumerate(self.pipes):
            try:
                pipe.send_bytes(data)
            except OSError:
                self._raise_dead(rank)

    def _next_output(self) -> ModelRunnerOutput:
        return self._wait(0)[1]

    def shutdown(self) -> None:
        for pipe in self.pipes:
            try:
                pipe.send_bytes(pickle.dumps(("shutdown",)))
            except OSError:
                pass
        deadline = time.monotonic() + SHUTDOWN_TIMEOUT_S
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()
        for pipe in self.pipes:
            pipe.close()
        self.processes, self.pipes = [], []
        atexit.unregister(self.shutdown)


def run_worker(rank: int, world_size: int, init_method: str, model_config, cache_config, scheduler_config,
               eos_token_ids: list[int], pipe: multiprocessing.connection.Connection) -> None:
    """A rank's process (spawned): builds its worker, reports ("ready",
    num_blocks) or ("error", type name, message), then runs steps until
    shutdown or until its pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine's process decides when to stop
    tag_process_logs()
    exit_with_parent()

    def send(message: tuple) -> None:
        pipe.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    try:
        worker = start_worker(rank, world_size, init_method, model_config, cache_config, scheduler_config,
                              eos_token_ids, device_index=rank)
    except BaseException as exc:  # noqa: BLE001 -- reported to the engine, which raises it
        send(("error", type(exc).__name__, str(exc)))
        raise SystemExit(1) from None
    send(("ready", worker.num_blocks))
    steps = RankSteps(rank, worker)
    try:
        while True:
            try:
                message = pickle.loads(pipe.recv_bytes())
            except EOFError:
                break
            if message[0] == "execute":
                output = steps.execute(message[1])
            elif message[0] == "flush":
                output = steps.flush()
            else:  # shutdown
                break
            if output is not None:
                send(("output", output))
    except BaseException as exc:  # noqa: BLE001 -- the engine fails with it
        logger.exception("worker rank %d failed", rank)
        try:
            send(("error", type(exc).__name__, str(exc)))
        except OSError:
            pass
        raise SystemExit(1) from None
    finally:
        from pagoda.distributed.parallel_state import destroy_model_parallel

        destroy_model_parallel()
