"""The executor interface the engine core steps through:
execute_model(scheduler output) returns at once with a future of the step's
ModelRunnerOutput, so the core can schedule the next step while this one
runs (async scheduling); futures resolve in the order the steps were sent.
Executors hold the workers (one per tensor-parallel rank); the engine sees
none of their tensors, only plain ids and logprobs."""

from __future__ import annotations

import abc
from typing import Iterable, Protocol

from pagoda.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig
from pagoda.core.scheduler import SchedulerOutput
from pagoda.outputs import ModelRunnerOutput


class StepFuture(Protocol):
    def result(self) -> ModelRunnerOutput: ...


class Executor(abc.ABC):
    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, scheduler_config: SchedulerConfig,
                 parallel_config: ParallelConfig, eos_token_ids: Iterable[int]):
        self.model_config, self.cache_config = model_config, cache_config
        self.scheduler_config, self.parallel_config = scheduler_config, parallel_config
        self.eos_token_ids = list(eos_token_ids)
        self.num_blocks = 0  # KV cache blocks every rank holds, set once the workers are up

    @abc.abstractmethod
    def execute_model(self, scheduled: SchedulerOutput) -> StepFuture:
        """Sends one step to the workers; raises if they are gone."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stops the workers; no process is left behind. Idempotent."""
