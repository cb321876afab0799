"""What the executors with a worker per rank (mp, ray) share, whatever
carries their messages: the rank's side (its start-up, and the step
protocol: queue a step, then hand back the previous one's result) and the
engine's side (step futures resolved in order, a flush for the newest step).

A rank answers a step's result once it has queued the next step (or when
asked to flush), so with async scheduling the device always has the next
step before the host reads the last one. Every rank runs every step; rank 0
alone hands its ModelRunnerOutput back (the ranks' samples agree: same
logits after the all-gather, same generators).
"""

from __future__ import annotations

import abc
import collections
import os
import socket

from pagoda.core.scheduler import SchedulerOutput
from pagoda.executor.abstract import Executor, StepFuture
from pagoda.logger import init_logger
from pagoda.outputs import ModelRunnerOutput

logger = init_logger(__name__)


class WorkerDiedError(RuntimeError):
    """A worker raised or exited: the engine cannot step any more."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start_worker(rank: int, world_size: int, init_method: str, model_config, cache_config, scheduler_config,
                 eos_token_ids: list[int], device_index: int):
    """Builds a rank's Worker on its device (cuda:device_index on GPUs),
    joined to the others through torch.distributed at init_method."""
    import torch

    from pagoda.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from pagoda.worker.worker import Worker

    if model_config.device.type == "cuda":
        torch.cuda.set_device(device_index)
        model_config.device = torch.device("cuda", device_index)
    else:  # the ranks share the cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    if world_size > 1:
        backend = "nccl" if model_config.device.type == "cuda" else "gloo"
        init_distributed_environment(world_size, rank, init_method, backend)
        initialize_model_parallel(world_size)
    logger.info("worker rank %d of %d on %s (pid %d)", rank, world_size, model_config.device, os.getpid())
    return Worker(model_config, cache_config, scheduler_config, eos_token_ids)


class RankSteps:
    """A rank's side of the step protocol around its worker."""

    def __init__(self, rank: int, worker):
        self.rank, self.worker = rank, worker
        self.pending = None  # the step queued last, its result not handed back yet

    def execute(self, scheduled: SchedulerOutput) -> ModelRunnerOutput | None:
        """Queues a step; returns the previous step's result (rank 0, if there
        was one; None otherwise)."""
        handle = self.worker.execute_model(scheduled)
        output = self.flush()
        self.pending = handle
        return output

    def flush(self) -> ModelRunnerOutput | None:
        """The pending step's result (rank 0; None otherwise). Every rank
        reads it: that also keeps its requests' sampled ids."""
        handle, self.pending = self.pending, None
        output = None if handle is None else handle.result()
        return output if self.rank == 0 else None


class _Future:
    def __init__(self, executor: RankedExecutor):
        self.executor = executor
        self.output: ModelRunnerOutput | None = None

    def result(self) -> ModelRunnerOutput:
        while self.output is None:
            self.executor.receive(self)
        return self.output


class RankedExecutor(Executor):
    """The engine's side of the step protocol: _send carries a message
    (("execute", scheduler output) or ("flush",)) to every rank,
    _next_output reads rank 0's next result, both raising WorkerDiedError
    when a rank is gone."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._pending: collections.deque[_Future] = collections.deque()  # sent, result not read, in order
        self._flushed = False  # the newest step was asked for its result

    @abc.abstractmethod
    def _send(self, message: tuple) -> None: ...

    @abc.abstractmethod
    def _next_output(self) -> ModelRunnerOutput: ...

    def execute_model(self, scheduled: SchedulerOutput) -> StepFuture:
        self._send(("execute", scheduled))
        future = _Future(self)
        self._pending.append(future)
        self._flushed = False
        return future

    def receive(self, future: _Future) -> None:
        """Reads rank 0's next result (for the oldest pending step); asks
        for it first when it is the newest step's, which no later step
        will bring."""
        if future is self._pending[-1] and not self._flushed:
            self._send(("flush",))
            self._flushed = True
        self._pending.popleft().output = self._next_output()
