"""LLMEngine: add_request / step / abort_request -- the front end
(Processor: tokenization and checks; OutputProcessor: detokenization, stop
strings, outputs) around an EngineCore (scheduler, model, sampler). The
offline LLM and the tests drive it. The core runs
  - in this process (the default): step() runs a core step, then its
    outputs; simple to debug and to look inside, or
  - in a process of its own (with_core_process, as `pagoda serve` runs it):
    the core steps on its own and step() processes what it sent meanwhile,
    so detokenization and output bookkeeping never make the device wait.

Data flows one way each step: core step (scheduler decision -> model ->
sampler -> token ids) -> output processor -> RequestOutputs, and the
sequences the front end ended (stop strings) back to the core as aborts.
"""

from __future__ import annotations

import weakref
from typing import Any, Iterable

from pagoda.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig
from pagoda.engine.core import EngineCore
from pagoda.engine.core_messages import EngineCoreOutput, EngineCoreReady, EngineCoreRequest
from pagoda.engine.output_processor import OutputProcessor, OutputProcessorResult
from pagoda.engine.processor import Processor, eos_token_ids, front_end_model_config, load_tokenizer
from pagoda.outputs import RequestOutput, RequestOutputKind
from pagoda.sampling_params import SamplingParams


class SyncInprocClient:
    """The core in this process: get_outputs() runs one core step.
    core_client.SyncMPClient's methods, so the engine has one path either
    way (kept here: that module imports ZeroMQ, which this one never needs)."""

    core_pid = None

    def __init__(self, core: EngineCore):
        self.core = core
        self.ready: EngineCoreReady = core.ready_message()

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        self.core.add_requests(requests)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.core.abort_requests(request_ids)

    def call_utility(self, method: str, *args):
        return self.core.call_utility(method, args)

    def get_outputs(self) -> list[EngineCoreOutput]:
        return self.core.step()

    def shutdown(self, timeout: float | None = None) -> None:
        """Stops the workers (timeout: SyncMPClient's, unused here)."""
        self.core.shutdown()


class LLMEngine:
    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, scheduler_config: SchedulerConfig,
                 parallel_config: ParallelConfig | None = None):
        """The engine with its core in this process."""
        tokenizer = self._init_front_end(model_config)
        self.core = EngineCore(model_config, cache_config, scheduler_config, parallel_config, self.eos_token_ids,
                               tokenizer=tokenizer)
        self.client = SyncInprocClient(self.core)

    @classmethod
    def with_core_process(cls, args) -> LLMEngine:
        """The engine with its core in a process of its own (started here,
        stopped by shutdown() or when the engine is collected)."""
        from pagoda.engine.core_client import CoreStart, SyncMPClient

        self = cls.__new__(cls)
        start = CoreStart(args)  # first: the core imports and loads while this process reads its tokenizer
        with start.cancelled_on_failure():
            model_config = front_end_model_config(args)
            self._init_front_end(model_config)
        self.core = None
        self.client = SyncMPClient(start, self.eos_token_ids)
        model_config.adopt_core_start(self.client.ready)
        weakref.finalize(self, self.client.shutdown, 10.0)
        return self

    def _init_front_end(self, model_config: ModelConfig):
        self.model_config = model_config
        # skip_tokenizer_init (vLLM's): token-id prompts only, outputs without text.
        self.tokenizer = None if model_config.skip_tokenizer_init else load_tokenizer(model_config)
        self.eos_token_ids = eos_token_ids(model_config, self.tokenizer)
        self.processor = Processor(model_config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.vocab_size = self.processor.vocab_size
        return self.tokenizer

    @property
    def core_pid(self) -> int | None:
        """The engine-core process (None: the core runs in this process)."""
        return self.client.core_pid

    def _inproc_core(self) -> EngineCore:
        if self.core is None:
            raise RuntimeError("the engine core runs in another process (multiprocess=True): "
                               "its scheduler and workers are not reachable from here")
        return self.core

    # The core's parts, for tests and tools that look inside.
    @property
    def scheduler(self):
        return self._inproc_core().scheduler

    @property
    def kv_cache_manager(self):
        return self._inproc_core().kv_cache_manager

    @property
    def worker(self):
        """The in-process worker (the uni executor's; other executors keep
        theirs in other processes)."""
        return self._inproc_core().executor.worker

    @property
    def runner(self):
        return self.worker.runner

    @property
    def async_scheduling(self) -> bool:
        return self.client.ready.async_scheduling

    @property
    def fault_hook(self):
        """A test hook, called as hook(stage, request_ids) where a step works
        on those sequences ("prepare", "sample", "prompt logprobs" in the
        worker, "output" in the front end); what it raises is handled as a
        failure of that work."""
        return self.output_processor.fault_hook

    @fault_hook.setter
    def fault_hook(self, hook) -> None:
        self.worker.fault_hook = self.output_processor.fault_hook = hook  # in process only

    def shutdown(self) -> None:
        """Stops the workers (their processes, with a multi-process executor)
        and the core's process if it has one."""
        self.client.shutdown()

    # --- requests -----------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | dict[str, Any],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
    ) -> None:
        """Validates and queues a request; ValueError (naming the field) on bad
        input. With output_kind FINAL_ONLY, step() returns the request's output
        only when it finishes (no per-token copies: the offline LLM's choice)."""
        if request_id in self.output_processor.states:
            raise ValueError(f"request_id {request_id!r} is already in use")
        state, core_requests = self.processor.process(request_id, prompt, params, arrival_time, priority, output_kind)
        self.output_processor.add_request(state)
        self.client.add_requests(core_requests)

    def abort_request(self, request_ids: str | Iterable[str]) -> list[RequestOutput]:
        """Ends requests now (finish_reason "abort") and frees their KV
        blocks; returns their final outputs."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        return self._apply(self.output_processor.abort_requests(request_ids))

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix (EngineCore.reset_prefix_cache);
        False while requests hold KV blocks."""
        return self.client.call_utility("reset_prefix_cache")

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.states)

    # --- the step -----------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Runs one core step (a core in its own process: takes the steps it
        made since the last call, waiting for one) and returns the outputs of
        the requests that advanced (finished ones for the last time)."""
        return self._apply(self.output_processor.process_outputs(self.client.get_outputs()))

    def _apply(self, result: OutputProcessorResult) -> list[RequestOutput]:
        self.client.abort_requests(result.reqs_to_abort)
        return result.request_outputs
