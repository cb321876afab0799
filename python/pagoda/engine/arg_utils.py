"""EngineArgs (vLLM's name): the user-facing engine arguments in one place, so
the offline `LLM` and the streaming `AsyncLLM` build their engine the same way."""

from __future__ import annotations

import time
from dataclasses import dataclass

from pagoda.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig
from pagoda.logger import init_logger

logger = init_logger(__name__)


@dataclass
class EngineArgs:
    model: str
    tokenizer: str | None = None
    skip_tokenizer_init: bool = False  # no tokenizer: token-id prompts, token-id outputs (no text)
    hf_overrides: dict | None = None  # config.json values to replace (e.g. a smaller model shape)
    dtype: str = "auto"
    max_model_len: int | None = None
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    seed: int = 0
    device: str = "auto"  # "auto" (CUDA where usable, else CPU), "cpu", "cuda"
    load_format: str = "auto"
    quantization: str = "auto"  # "fp8" (FP8 weights and GEMMs), "gguf" (packed GGUF on the CPU), "gguf_int8" (packed, int8 inputs), "int8" (int8 weights and inputs, CPU), "none"/"auto"
    kv_cache_space: float = 4
    enforce_eager: bool = False  # GPU: no CUDA graphs
    max_cudagraph_capture_size: int = 512  # GPU: the largest step (tokens) CUDA graphs serve
    gpu_memory_utilization: float = 0.9  # GPU: share of the device's memory the engine may use (weights + KV cache)
    kv_cache_dtype: str = "auto"  # one of config.KV_CACHE_DTYPES
    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None  # "uni", "mp" or "ray"; None: uni for one rank, else mp
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"  # or "priority"
    async_scheduling: bool | None = None  # None: on for CUDA, off on the CPU
    # vLLM's flag and defaults: LLM passes True (quiet offline runs), AsyncLLM False.
    disable_log_stats: bool = True
    stats_interval: float = 10.0  # seconds between stats lines

    def create_model_config(self) -> ModelConfig:
        return ModelConfig(
            model=self.model, tokenizer=self.tokenizer, dtype=self.dtype, max_model_len=self.max_model_len,
            seed=self.seed, load_format=self.load_format, skip_tokenizer_init=self.skip_tokenizer_init,
            hf_overrides=self.hf_overrides, device=self.device, enforce_eager=self.enforce_eager,
            max_cudagraph_capture_size=self.max_cudagraph_capture_size, quantization=self.quantization,
        )

    def create_engine_configs(self) -> tuple[ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig]:
        from pagoda.distributed.utils import verify_tensor_parallel

        parallel_config = ParallelConfig(self.tensor_parallel_size, self.distributed_executor_backend)
        model_config = self.create_model_config()
        max_num_batched_tokens = self.max_num_batched_tokens
        if max_num_batched_tokens is None:
            max_num_batched_tokens = max(4096, min(model_config.max_model_len, 8192))
        cache_config = CacheConfig(
            block_size=self.block_size, kv_cache_space=self.kv_cache_space,
            num_gpu_blocks_override=self.num_gpu_blocks_override, enable_prefix_caching=self.enable_prefix_caching,
            gpu_memory_utilization=self.gpu_memory_utilization, kv_cache_dtype=self.kv_cache_dtype,
        )
        cache_config.kv_cache_torch_dtype(model_config)  # an impossible fp8 cache fails before any weight loads
        scheduler_config = SchedulerConfig(
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            scheduling_policy=self.scheduling_policy, async_scheduling=self.async_scheduling,
        )
        # Before any worker starts: a dimension that does not divide is the user's error.
        verify_tensor_parallel(model_config.hf_config, parallel_config.tensor_parallel_size)
        return model_config, cache_config, scheduler_config, parallel_config

    def create_engine(self, multiprocess: bool = False):
        """An LLMEngine; multiprocess: its core (scheduler, model) in a
        process of its own, stepping while this one detokenizes."""
        from pagoda.engine.llm_engine import LLMEngine
        from pagoda.metrics import StatLogger

        started = time.perf_counter()
        if multiprocess:
            engine = LLMEngine.with_core_process(self)  # the core process logs the stats
        else:
            engine = LLMEngine(*self.create_engine_configs())
            if not self.disable_log_stats:
                engine.core.stat_logger = StatLogger(self.stats_interval)
        # Config, tokenizer and model runner together: the cold start a user waits for.
        logger.info(
            "engine ready in %.1f s (async scheduling %s)",
            time.perf_counter() - started, "on" if engine.async_scheduling else "off",
        )
        return engine
