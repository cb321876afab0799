"""EngineArgs (vLLM's name): the user-facing engine arguments in one place, so
the offline `LLM` and the streaming `AsyncLLM` build their engine the same way."""

from __future__ import annotations

from dataclasses import dataclass

from pagoda.config import CacheConfig, ModelConfig, SchedulerConfig


@dataclass
class EngineArgs:
    model: str
    tokenizer: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    seed: int = 0
    device: str = "auto"
    load_format: str = "auto"
    kv_cache_space: float = 4
    enforce_eager: bool = False
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"  # or "priority"
    # vLLM's flag and defaults: LLM passes True (quiet offline runs), AsyncLLM False.
    disable_log_stats: bool = True
    stats_interval: float = 10.0  # seconds between stats lines

    def create_engine_configs(self) -> tuple[ModelConfig, CacheConfig, SchedulerConfig]:
        if self.device not in ("auto", "cpu"):
            raise ValueError(f"device={self.device!r}: this build of Pagoda runs on the CPU only (the GPU runner is not built yet)")
        model_config = ModelConfig(
            model=self.model, tokenizer=self.tokenizer, dtype=self.dtype, max_model_len=self.max_model_len,
            seed=self.seed, load_format=self.load_format,
        )
        max_num_batched_tokens = self.max_num_batched_tokens
        if max_num_batched_tokens is None:
            max_num_batched_tokens = max(4096, min(model_config.max_model_len, 8192))
        cache_config = CacheConfig(
            block_size=self.block_size, kv_cache_space=self.kv_cache_space,
            num_gpu_blocks_override=self.num_gpu_blocks_override, enable_prefix_caching=self.enable_prefix_caching,
        )
        scheduler_config = SchedulerConfig(
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            scheduling_policy=self.scheduling_policy,
        )
        return model_config, cache_config, scheduler_config

    def create_engine(self):
        from pagoda.engine.llm_engine import LLMEngine
        from pagoda.metrics import StatLogger

        engine = LLMEngine(*self.create_engine_configs())
        if not self.disable_log_stats:
            engine.stat_logger = StatLogger(engine, self.stats_interval)
        return engine
