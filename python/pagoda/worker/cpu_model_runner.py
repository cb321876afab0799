"""The CPU runner: a KV cache of kv_cache_space bytes (vLLM's
VLLM_CPU_KVCACHE_SPACE), always eager."""

from __future__ import annotations

from pagoda.worker.model_runner import ModelRunner


class CPUModelRunner(ModelRunner):
    def determine_num_blocks(self) -> int:
        cache_config = self.cache_config
        if cache_config.num_gpu_blocks_override is not None:
            return cache_config.num_gpu_blocks_override
        num_blocks = min(cache_config.kv_cache_bytes // self.block_bytes(), self.max_useful_blocks())
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_space={cache_config.kv_cache_space} holds no KV cache block of "
                f"{self.block_bytes()} bytes: raise kv_cache_space"
            )
        return int(num_blocks)
