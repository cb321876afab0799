"""The in-process executor: one worker in the engine's own process (one
device, the default), its futures the worker's own step handles."""

from __future__ import annotations

from pagoda.core.scheduler import SchedulerOutput
from pagoda.executor.abstract import Executor, StepFuture
from pagoda.worker.worker import Worker


class UniProcExecutor(Executor):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.worker = Worker(self.model_config, self.cache_config, self.scheduler_config, self.eos_token_ids)
        self.num_blocks = self.worker.num_blocks

    def execute_model(self, scheduled: SchedulerOutput) -> StepFuture:
        return self.worker.execute_model(scheduled)

    def shutdown(self) -> None:
        pass
