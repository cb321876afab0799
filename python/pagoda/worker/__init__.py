"""Model runners: the CPU one and the CUDA one, chosen by the model config's
device (see pagoda.config.resolve_device)."""

from __future__ import annotations

from pagoda.config import CacheConfig, ModelConfig, SchedulerConfig


def create_model_runner(model_config: ModelConfig, cache_config: CacheConfig, scheduler_config: SchedulerConfig):
    if model_config.device.type == "cuda":
        from pagoda.worker.gpu_model_runner import GPUModelRunner

        return GPUModelRunner(model_config, cache_config, scheduler_config)
    from pagoda.worker.cpu_model_runner import CPUModelRunner

    return CPUModelRunner(model_config, cache_config, scheduler_config)
