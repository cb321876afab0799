"""LLMEngine: add_request / step / abort_request, all in one process -- the
front end (Processor: tokenization and checks; OutputProcessor:
detokenization, stop strings, outputs) around an in-process EngineCore
(scheduler, model, sampler). The offline LLM and the tests drive it; the
server runs the same pieces with the core in its own process (AsyncLLM).

Data flows one way each step: core step (scheduler decision -> model ->
sampler -> token ids) -> output processor -> RequestOutputs, and the
sequences the front end ended (stop strings) back to the core as aborts.
"""

from __future__ import annotations

from typing import Any, Iterable

from pagoda.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig
from pagoda.engine.core import EngineCore
from pagoda.engine.output_processor import OutputProcessor, OutputProcessorResult
from pagoda.engine.processor import Processor, eos_token_ids, load_tokenizer
from pagoda.outputs import RequestOutput, RequestOutputKind
from pagoda.sampling_params import SamplingParams


class LLMEngine:
    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, scheduler_config: SchedulerConfig,
                 parallel_config: ParallelConfig | None = None):
        self.model_config = model_config
        # skip_tokenizer_init (vLLM's): token-id prompts only, outputs without text.
        self.tokenizer = None if model_config.skip_tokenizer_init else load_tokenizer(model_config)
        self.eos_token_ids = eos_token_ids(model_config, self.tokenizer)
        self.core = EngineCore(model_config, cache_config, scheduler_config, parallel_config, self.eos_token_ids,
                               tokenizer=self.tokenizer)
        self.processor = Processor(model_config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.vocab_size = self.processor.vocab_size

    # The core's parts, for tests and tools that look inside.
    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def kv_cache_manager(self):
        return self.core.kv_cache_manager

    @property
    def worker(self):
        """The in-process worker (the uni executor's; other executors keep
        theirs in other processes)."""
        return self.core.executor.worker

    @property
    def runner(self):
        return self.worker.runner

    @property
    def async_scheduling(self) -> bool:
        return self.core.async_scheduling

    @property
    def fault_hook(self):
        """A test hook, called as hook(stage, request_ids) where a step works
        on those sequences ("prepare", "sample", "prompt logprobs" in the
        worker, "output" in the front end); what it raises is handled as a
        failure of that work."""
        return self.output_processor.fault_hook

    @fault_hook.setter
    def fault_hook(self, hook) -> None:
        self.worker.fault_hook = self.output_processor.fault_hook = hook

    def shutdown(self) -> None:
        """Stops the workers (their processes, with a multi-process executor)."""
        self.core.shutdown()

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
        for core_request in core_requests:
            self.core.add_request(core_request)

    def abort_request(self, request_ids: str | Iterable[str]) -> list[RequestOutput]:
        """Ends requests now (finish_reason "abort") and frees their KV
        blocks; returns their final outputs."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        return self._apply(self.output_processor.abort_requests(request_ids))

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.states)

    # --- the step -----------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Runs one core step and returns the outputs of the requests that
        advanced (finished ones for the last time)."""
        return self._apply(self.output_processor.process_outputs(self.core.step()))

    def _apply(self, result: OutputProcessorResult) -> list[RequestOutput]:
        self.core.abort_requests(result.reqs_to_abort)
        return result.request_outputs
