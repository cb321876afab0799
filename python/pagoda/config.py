"""Engine configuration: which model and how to load it, the KV cache, and the
scheduler's limits. Values are validated here, with a ValueError naming the
field, before anything is allocated."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "float": torch.float32, "half": torch.float16}
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
GiB = 1 << 30


def _find_gguf(path: Path) -> tuple[Path, str | None]:
    """(folder, gguf file name or None) for a model path."""
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model {path} is a file but not a .gguf file")
        return path.parent, path.name
    if not path.is_dir():
        raise ValueError(f"model {str(path)!r} is neither a folder nor a .gguf file (models load from disk; no hub downloads)")
    if (path / "config.json").exists():
        return path, None
    ggufs = sorted(p.name for p in path.glob("*.gguf"))
    if len(ggufs) == 1:
        return path, ggufs[0]
    if ggufs:
        raise ValueError(f"model folder {path} holds several .gguf files {ggufs}: pass the file itself")
    raise ValueError(f"model folder {path} has no config.json and no .gguf file")


@dataclass
class ModelConfig:
    model: str
    tokenizer: str | None = None
    dtype: str | torch.dtype = "auto"
    max_model_len: int | None = None
    seed: int = 0
    load_format: str = "auto"

    def __post_init__(self):
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        self.folder, self.gguf_file = _find_gguf(Path(self.model).expanduser())
        if self.load_format == "gguf" and self.gguf_file is None:
            raise ValueError(f"load_format='gguf' but {self.model} is not a GGUF model")
        self.hf_config = self._load_hf_config()
        self.torch_dtype = self._resolve_dtype()
        self.max_model_len = self._resolve_max_model_len()
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")

    def _load_hf_config(self):
        from transformers import AutoConfig

        if self.gguf_file:
            return AutoConfig.from_pretrained(self.folder, gguf_file=self.gguf_file)
        return AutoConfig.from_pretrained(self.folder)

    def _resolve_dtype(self) -> torch.dtype:
        if isinstance(self.dtype, torch.dtype):
            dtype = self.dtype
        elif self.dtype == "auto":
            # The checkpoint's dtype; fp16 becomes bf16 on the CPU (no fast fp16
            # matmuls there), and GGUF (dequantized) or unspecified -> fp32.
            dtype = getattr(self.hf_config, "dtype", None) or getattr(self.hf_config, "torch_dtype", None)
            if isinstance(dtype, str):
                dtype = _DTYPES.get(dtype, torch.float32)
            if dtype is None or self.gguf_file:
                dtype = torch.float32
            if dtype == torch.float16:
                dtype = torch.bfloat16
        elif self.dtype in _DTYPES:
            dtype = _DTYPES[self.dtype]
        else:
            raise ValueError(f"dtype must be 'auto', 'float32', 'bfloat16' or 'float16', got {self.dtype!r}")
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"dtype {dtype} is not supported (use float32, bfloat16 or float16)")
        return dtype

    def _resolve_max_model_len(self) -> int:
        limit = getattr(self.hf_config, "max_position_embeddings", None)
        if self.max_model_len is None:
            if limit is None:
                raise ValueError("the model config has no max_position_embeddings: pass max_model_len")
            return int(limit)
        if not isinstance(self.max_model_len, int) or self.max_model_len < 2:
            raise ValueError(f"max_model_len must be an int >= 2, got {self.max_model_len!r}")
        if limit is not None and self.max_model_len > limit:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's max_position_embeddings={limit}")
        return self.max_model_len

    @property
    def generation_config(self) -> dict:
        """The model's generation_config.json (sampling defaults), if any."""
        path = self.folder / "generation_config.json"
        return json.loads(path.read_text()) if path.exists() and not self.gguf_file else {}


@dataclass
class CacheConfig:
    block_size: int = 16
    # CPU KV cache size (vLLM's VLLM_CPU_KVCACHE_SPACE): bytes, or GiB when < 4096.
    kv_cache_space: float = 4
    # Exactly this many blocks instead of sizing from kv_cache_space (vLLM's name; tests, debugging).
    num_gpu_blocks_override: int | None = None
    # Automatic prefix caching (vLLM v1's default): full blocks are shared by prompts that start alike.
    enable_prefix_caching: bool = True

    def __post_init__(self):
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}")
        if not isinstance(self.block_size, int) or self.block_size < 1 or self.block_size > 256:
            raise ValueError(f"block_size must be an int in [1, 256], got {self.block_size!r}")
        if not self.kv_cache_space or self.kv_cache_space <= 0:
            raise ValueError(f"kv_cache_space must be positive (bytes, or GiB when < 4096), got {self.kv_cache_space!r}")
        if self.num_gpu_blocks_override is not None and (
            not isinstance(self.num_gpu_blocks_override, int) or self.num_gpu_blocks_override < 1
        ):
            raise ValueError(f"num_gpu_blocks_override must be a positive int, got {self.num_gpu_blocks_override!r}")

    @property
    def kv_cache_bytes(self) -> int:
        space = self.kv_cache_space
        return int(space * GiB) if space < 4096 else int(space)


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    # "fcfs" (arrival order) or "priority" (lowest request priority value first, ties by arrival).
    scheduling_policy: str = "fcfs"

    def __post_init__(self):
        from pagoda.core.request_queue import SCHEDULING_POLICIES

        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
