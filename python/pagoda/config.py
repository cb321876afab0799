"""Engine configuration: which model and how to load it, the KV cache, and the
scheduler's limits. Values are validated here, with a ValueError naming the
field, before anything is allocated."""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pagoda.logger import init_logger

if TYPE_CHECKING:
    import torch

# torch is imported where a value needs it, not at the top: an offline LLM
# with its core in another process starts that process before this one
# imports torch (seconds), so that the two imports overlap (see
# probable_device_type and CoreStart).

logger = init_logger(__name__)

_DTYPE_NAMES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16", "float": "float32",
                "half": "float16"}
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
QUANTIZATIONS = ("auto", "gguf", "gguf_int8", "int8", "fp8", "none")
# "auto": the model's dtype, except bf16 under quantization="gguf_int8" or "int8"
# (llama.cpp's way there too: a 16-bit cache; see kv_cache_torch_dtype);
# "bfloat16": bf16 also under an fp32 model (the CPU's kernels round K/V on
# the write), half the bytes a decode step reads; "float32": an fp32 model's
# own dtype, whatever its quantization; "fp8" (= "fp8_e4m3", vLLM's names):
# float8 e4m3 with unit scale, half again. No "float16": where the model is
# fp16 "auto" is that, and under fp32 its range (65504) is narrower than the
# activations' where bf16's is not.
KV_CACHE_DTYPES = ("auto", "bfloat16", "float32", "fp8", "fp8_e4m3")
# Head sizes the GPU tensor-core attention kernel (the one that reads fp8) covers.
FP8_KV_HEAD_SIZES = (64, 80, 96, 128, 256)
GiB = 1 << 30


def check_fp8_support(what: str, dtype: torch.dtype, device: torch.device) -> None:
    """Float8 weights and KV caches compute in bf16/fp16, and on a GPU need
    its FP8 instructions (CUDA capability 8.9+); ValueError naming `what`
    otherwise. Whether the CPU may run `what` is the caller's to say."""
    import torch

    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"{what} computes in bfloat16 or float16, got dtype {dtype}: pass --dtype bfloat16")
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 9):
            raise ValueError(f"{what} needs a GPU of CUDA capability 8.9+ (Ada, Hopper), "
                             f"this one has {capability[0]}.{capability[1]}")


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


DEVICES = ("auto", "cpu", "cuda")


def resolve_device(device: str | torch.device) -> torch.device:
    """"auto" -> CUDA when torch sees a GPU and Pagoda's CUDA kernels are
    loaded, else the CPU; "cuda" insists (ValueError saying what is missing)."""
    import torch

    if device_type(device) == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def device_type(device: str | torch.device) -> str:
    """"cpu" or "cuda": where resolve_device puts a model, without making a
    CUDA context in this process."""
    name = _device_name(device)
    if name == "cpu":
        return "cpu"
    import torch

    from pagoda import _native  # the compiled kernels: whether the CUDA ones loaded

    if not torch.cuda.is_available():
        if name == "cuda":
            raise ValueError(
                f"device='cuda' but torch {torch.__version__} sees no CUDA GPU "
                f"({'a CPU-only build' if torch.version.cuda is None else 'built for CUDA ' + torch.version.cuda})"
            )
        return "cpu"
    if not _native.has_cuda_ops():
        missing = (
            "Pagoda's CUDA kernels are not loaded (no _cuda_ops.so beside pagoda/_C.so): build them with "
            "`python tools/build_ext.py` or `tools/bazel build --config=cuda //python/pagoda:all`"
        )
        if name == "cuda":
            raise ValueError(f"device='cuda' but {missing}")
        logger.warning("device='auto' runs on the CPU although torch sees a GPU: %s", missing)
        return "cpu"
    return "cuda"


def _device_name(device) -> str:
    """"auto", "cpu" or "cuda" from a name or a torch.device (ValueError otherwise)."""
    is_torch_device = type(device).__name__ == "device" and type(device).__module__ == "torch"
    name = device.type if is_torch_device else device
    if name not in DEVICES or (is_torch_device and device.index not in (None, 0)):
        raise ValueError(f"device must be one of {DEVICES}, got {device!r} (pick a GPU with CUDA_VISIBLE_DEVICES)")
    return name


def probable_device_type(device: str | torch.device) -> str:
    """device_type's answer without importing torch, for "auto" as far as
    files and the NVIDIA driver tell: "cuda" when torch is a CUDA build,
    Pagoda's CUDA kernels are built beside it and NVML counts a visible GPU.
    It decides where the offline LLM's core runs before torch is imported;
    the core itself then resolves the device for real (device_type), so a
    wrong guess costs only that choice."""
    name = _device_name(device)
    if name != "auto":
        return name
    torch_spec = importlib.util.find_spec("torch")
    if torch_spec is None or not torch_spec.submodule_search_locations:
        return "cpu"
    if not (Path(torch_spec.submodule_search_locations[0]) / "lib" / "libtorch_cuda.so").exists():
        return "cpu"
    from pagoda import _native  # its library lookup imports no torch

    if _native.find_library("_cuda_ops") is None:
        return "cpu"
    return "cuda" if _visible_nvidia_gpus() > 0 else "cpu"


def _visible_nvidia_gpus() -> int:
    """GPUs NVML sees, less those CUDA_VISIBLE_DEVICES hides (0 without a driver)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and (not visible.strip() or visible.strip().startswith("-")):
        return 0
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return 0
    if nvml.nvmlInit_v2() != 0:
        return 0
    try:
        count = ctypes.c_uint(0)
        if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            return 0
        if visible is not None:
            return min(count.value, len([d for d in visible.split(",") if d.strip()]))
        return count.value
    finally:
        nvml.nvmlShutdown()


@dataclass
class ModelConfig:
    model: str
    tokenizer: str | None = None
    dtype: str | torch.dtype = "auto"
    max_model_len: int | None = None
    seed: int = 0
    load_format: str = "auto"
    # vLLM's: no tokenizer (prompts are token ids, outputs carry ids and no text).
    skip_tokenizer_init: bool = False
    # vLLM's: config.json values replaced before the model is built (e.g. a smaller model shape).
    hf_overrides: dict | None = None
    # "auto" (CUDA where usable, else CPU), "cpu" or "cuda"; resolved to a torch.device here
    # because the default dtype depends on it.
    device: str | torch.device = "auto"
    # vLLM's: no CUDA graphs (every step runs eagerly).
    enforce_eager: bool = False
    # vLLM's: the largest step, in tokens, a CUDA graph serves. Decode steps of up
    # to min(this, max_num_seqs) sequences replay full graphs; other steps (prefill
    # in them) of up to this many tokens replay piecewise graphs, attention eager
    # between the pieces (worker/cuda_graph_runner.py); larger steps run eagerly.
    max_cudagraph_capture_size: int = 512
    # GGUF weights: "gguf" keeps Q4_0/Q4_1/Q8_0/Q4_K/Q6_K matrices packed for the CPU's
    # kernels (GGUF model, CPU, float32; the blocks are dequantized in
    # registers and multiplied in fp32, so the results are those of "none" up
    # to the order of fp32 sums, from a fifth of the bytes), "none"
    # dequantizes them to dtype at load. "auto" is gguf wherever it applies
    # (SmolLM2: the same greedy tokens as none, a batch-1 request 4.8x
    # faster, 0.57x the peak memory; docs/BENCHMARKS.md), else none.
    # "gguf_int8": packed as gguf, and their products (all five types) take their
    # inputs rounded to int8 per block of 32 (llama.cpp's way; AVX512_VNNI
    # where the CPU has it): faster at many rows, not the same tokens as none
    # (docs/BENCHMARKS.md states the tolerance). "int8": every linear layer's
    # weight (and the LM head's) requantized at load to int8 with one scale per
    # row and group of up to 256 values, its inputs rounded likewise, integer
    # products summed a group at a time (model_executor/layers/int8.py; CPU,
    # float32, any checkpoint): gguf_int8's tolerance, faster at many rows,
    # twice Q4's bytes. "fp8": the linear layers' weights
    # quantized to float8 e4m3 at load (per output channel), activations per
    # token, FP8 tensor-core GEMMs (model_executor/layers/fp8.py); bf16/fp16
    # models.
    # Resolved to "gguf", "gguf_int8", "int8", "fp8" or None.
    quantization: str | None = "auto"

    def __post_init__(self):
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        self.folder, self.gguf_file = _find_gguf(Path(self.model).expanduser())
        if self.load_format == "gguf" and self.gguf_file is None:
            raise ValueError(f"load_format='gguf' but {self.model} is not a GGUF model")
        self.hf_config = self._load_hf_config()
        if self.hf_overrides is not None:
            if not isinstance(self.hf_overrides, dict):
                raise ValueError(f"hf_overrides must be a dict of config.json keys, got {self.hf_overrides!r}")
            self.hf_config.update(self.hf_overrides)
        if not isinstance(self.skip_tokenizer_init, bool):
            raise ValueError(f"skip_tokenizer_init must be a bool, got {self.skip_tokenizer_init!r}")
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager must be a bool, got {self.enforce_eager!r}")
        size = self.max_cudagraph_capture_size
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(
                f"max_cudagraph_capture_size must be a positive int, got {size!r}")
        self.device = resolve_device(self.device)
        self.torch_dtype = self._resolve_dtype()
        self.quantization = self._resolve_quantization()
        # The model's own limit may be lowered to fit the KV cache; one the user set may not.
        self.max_model_len_is_default = self.max_model_len is None
        self.max_model_len = self._resolve_max_model_len()
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")

    def adopt_core_start(self, ready) -> None:
        """What an engine core in another process decided at start-up (its
        EngineCoreReady), into this front end's config: max_model_len (it
        may be fitted to the KV cache), the dtype and the device the model
        runs in."""
        import torch

        self.max_model_len = ready.max_model_len
        self.torch_dtype = getattr(torch, ready.dtype)
        self.device = torch.device(ready.device)

    def _load_hf_config(self):
        if self.gguf_file:
            from pagoda.transformers_utils.gguf_config import load_gguf_config

            return load_gguf_config(self.folder / self.gguf_file)
        from pagoda.transformers_utils.hf_config import load_hf_config

        return load_hf_config(self.folder)

    def _resolve_dtype(self) -> torch.dtype:
        import torch

        if isinstance(self.dtype, torch.dtype):
            dtype = self.dtype
        elif self.dtype == "auto":
            # CPU: the checkpoint's dtype; fp16 becomes bf16 (no fast fp16
            # matmuls there), and GGUF (dequantized) or unspecified -> fp32.
            # GPU (vLLM's rule): fp16 and bf16 checkpoints keep their dtype,
            # fp32, GGUF and unspecified run in bf16 (tensor cores; fp32 would
            # halve the KV cache and the throughput).
            dtype = getattr(self.hf_config, "dtype", None) or getattr(self.hf_config, "torch_dtype", None)
            if isinstance(dtype, str):
                dtype = getattr(torch, _DTYPE_NAMES.get(dtype, "float32"))
            if dtype is None or self.gguf_file or self.quantization == "int8":  # int8's kernels take fp32
                dtype = torch.float32
            if self.device.type == "cpu" and dtype == torch.float16:
                dtype = torch.bfloat16
            if self.device.type != "cpu" and dtype == torch.float32:
                dtype = torch.bfloat16
        elif self.dtype in _DTYPE_NAMES:
            dtype = getattr(torch, _DTYPE_NAMES[self.dtype])
        else:
            raise ValueError(f"dtype must be 'auto', 'float32', 'bfloat16' or 'float16', got {self.dtype!r}")
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"dtype {dtype} is not supported (use float32, bfloat16 or float16)")
        return dtype

    def _resolve_quantization(self) -> str | None:
        import torch

        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        packable = (
            self.gguf_file is not None and self.load_format != "dummy" and self.device.type == "cpu"
            and self.torch_dtype == torch.float32
        )
        if self.quantization in ("gguf", "gguf_int8") and not packable:
            raise ValueError(
                f"quantization={self.quantization!r} (packed GGUF weights) needs a GGUF model on the CPU in float32, got "
                f"{'a GGUF' if self.gguf_file else 'a non-GGUF'} model on {self.device.type} in {self.torch_dtype}"
            )
        if self.quantization == "fp8":
            self._check_fp8()
            return "fp8"
        if self.quantization == "int8" and (self.device.type != "cpu" or self.torch_dtype != torch.float32):
            raise ValueError(f"quantization='int8' (the CPU's integer kernels, float32 activations) needs the CPU in "
                             f"float32, got {self.device.type} in {self.torch_dtype}: pass device='cpu' and "
                             "dtype='auto' or 'float32'")
        if self.quantization in ("gguf_int8", "int8"):
            return self.quantization
        return "gguf" if self.quantization == "gguf" or self.quantization == "auto" and packable else None

    def _check_fp8(self) -> None:
        check_fp8_support("quantization='fp8'", self.torch_dtype, self.device)
        if self.device.type != "cuda":
            logger.warning("quantization='fp8' on the CPU runs torch's reference FP8 GEMM, several times slower "
                           "than bfloat16: it is there to test the path, not for speed")

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

    def fit_to_kv_cache(self, capacity: int, memory_flag: str) -> None:
        """One sequence of max_model_len tokens must fit in a KV cache of
        `capacity` tokens, or a lone long request could never finish. The
        model's default is lowered with a warning (as vLLM does); a
        max_model_len the user asked for is a ValueError naming what helps.
        memory_flag: the flag that grows the cache on this device."""
        if self.max_model_len <= capacity:
            return
        if capacity < 2:
            raise ValueError(f"the KV cache holds only {capacity} token(s): raise {memory_flag}")
        if self.max_model_len_is_default:
            logger.warning("max_model_len lowered from the model's %d to %d tokens, all the KV cache holds "
                           "(raise %s for the full context)", self.max_model_len, capacity, memory_flag)
            self.max_model_len = capacity
            return
        raise ValueError(f"max_model_len={self.max_model_len} does not fit in the KV cache, which holds {capacity} "
                         f"tokens: pass --max-model-len {capacity} (or less), or raise {memory_flag}")

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
    # GPU: the share of the device's memory this engine may use (weights, activations, KV cache).
    gpu_memory_utilization: float = 0.9
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES

    def __post_init__(self):
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if (
            not isinstance(self.gpu_memory_utilization, (int, float))
            or isinstance(self.gpu_memory_utilization, bool)
            or not 0 < self.gpu_memory_utilization <= 1
        ):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
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

    def kv_cache_torch_dtype(self, model_config: ModelConfig) -> torch.dtype:
        """The KV cache's element type for this model; ValueError (naming
        what to change) where the bf16 or fp8 cache cannot run."""
        import torch

        dtype, device = model_config.torch_dtype, model_config.device
        if self.kv_cache_dtype == "auto":
            # gguf_int8 trades accuracy for speed as llama.cpp does, whose
            # cache is 16-bit too: the bf16 cache stays within gguf_int8's
            # tolerance against fp32 (tests/engine/test_smollm2.py) and makes
            # a batch-16 decode step's attention 1.3x faster (docs/BENCHMARKS.md).
            return torch.bfloat16 if model_config.quantization in ("gguf_int8", "int8") else dtype
        what = f"kv_cache_dtype={self.kv_cache_dtype!r}"
        if self.kv_cache_dtype == "float32":
            if dtype == torch.float32:
                return dtype
            raise ValueError(f"{what} needs a float32 model, this one runs in {str(dtype).removeprefix('torch.')}: "
                             "use kv_cache_dtype='auto'")
        if self.kv_cache_dtype == "bfloat16":
            if dtype == torch.bfloat16 or (dtype == torch.float32 and device.type == "cpu"):
                return torch.bfloat16
            raise ValueError(f"{what} needs a bfloat16 model, or a float32 one on the CPU (whose kernels round K/V "
                             f"to bfloat16); this model runs in {str(dtype).removeprefix('torch.')} on "
                             f"{device.type}: use kv_cache_dtype='auto'")
        if device.type != "cuda":
            raise ValueError(f"{what} needs a CUDA GPU (its attention kernels are CUDA's); use 'auto' on {device}")
        check_fp8_support(what, dtype, device)
        if self.block_size % 16:
            raise ValueError(f"{what} needs a block_size that is a multiple of 16, got {self.block_size}")
        return torch.float8_e4m3fn  # the model runner checks the head size (FP8_KV_HEAD_SIZES)

    @property
    def kv_cache_bytes(self) -> int:
        space = self.kv_cache_space
        return int(space * GiB) if space < 4096 else int(space)


SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    # "fcfs" (arrival order) or "priority" (lowest request priority value first, ties by arrival).
    scheduling_policy: str = "fcfs"
    # Queue each step before reading the previous one's samples, so host work
    # overlaps the device's (LLMEngine). None: on for CUDA, off on the CPU
    # (where host and "device" share the cores).
    async_scheduling: bool | None = None

    def __post_init__(self):
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.async_scheduling not in (None, True, False):
            raise ValueError(f"async_scheduling must be True, False or None (auto), got {self.async_scheduling!r}")


EXECUTOR_BACKENDS = ("uni", "mp", "ray")
# Ray is optional (the ray executor only); requirements.txt pins the same version.
RAY_REQUIREMENT = "ray==2.60.0"


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    # Where the workers run: "uni" (in the engine's process; one rank only), "mp"
    # (a process per rank, one machine) or "ray" (a Ray actor per rank, on the
    # nodes of a Ray cluster). None: uni for one rank, mp for more.
    distributed_executor_backend: str | None = None

    def __post_init__(self):
        size = self.tensor_parallel_size
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive int, got {size!r}")
        if self.distributed_executor_backend is None:
            self.distributed_executor_backend = "uni" if size == 1 else "mp"
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend must be one of {EXECUTOR_BACKENDS}, "
                             f"got {self.distributed_executor_backend!r}")
        if self.distributed_executor_backend == "ray" and importlib.util.find_spec("ray") is None:
            raise ValueError(f"distributed_executor_backend='ray' needs Ray, which is not installed: "
                             f"pip install {RAY_REQUIREMENT} ('mp' runs the ranks of one machine without it)")
        if self.distributed_executor_backend == "uni" and size != 1:
            raise ValueError(f"distributed_executor_backend='uni' runs one rank; tensor_parallel_size={size} "
                             "needs 'mp' or 'ray'")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size
