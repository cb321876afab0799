"""get_model(): a model of the config's architecture with its weights loaded,
in eval mode, without gradients."""

from __future__ import annotations

import os

import torch
from torch import nn

from pagoda.distributed.parallel_state import get_tensor_model_parallel_world_size
from pagoda.heap import return_freed_heap
from pagoda.logger import init_logger
from pagoda.model_executor.layers.fp8 import ALIGNMENT, quantize_linear_weights
from pagoda.model_executor.layers.int8 import quantize_int8_weights
from pagoda.model_executor.model_loader.dummy_loader import initialize_dummy_weights
from pagoda.model_executor.model_loader.gguf_loader import gguf_weights_iterator
from pagoda.model_executor.model_loader.safetensors_loader import safetensors_files, safetensors_weights_iterator
from pagoda.model_executor.models.registry import get_model_class
from pagoda.model_executor.weight_utils import quantize_packed_inputs

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
logger = init_logger(__name__)


def _gguf_path(model: str, gguf_file: str | None) -> str:
    if os.path.isfile(model):  # the file itself (gguf_file then only names it)
        return model
    if gguf_file is None:
        raise FileNotFoundError(f"{model!r} is not a GGUF file; for a folder, pass gguf_file=NAME")
    path = os.path.join(model, gguf_file)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file {path!r} does not exist")
    return path


def resolve_load_format(model: str, load_format: str = "auto", gguf_file: str | None = None) -> str:
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r}; choose one of {LOAD_FORMATS}")
    if load_format != "auto":
        return load_format
    return "gguf" if gguf_file or model.endswith(".gguf") else "safetensors"


def get_model(
    model: str | os.PathLike,
    hf_config,
    dtype: torch.dtype,
    load_format: str = "auto",
    gguf_file: str | None = None,
    device: torch.device | str | None = None,
    quantization: str | None = None,
) -> nn.Module:
    """model: a Hugging Face folder (safetensors), a folder holding gguf_file,
    or the .gguf file itself; ignored for load_format="dummy".

    Parameters are created directly on `device` (default: torch's default
    device) in `dtype`, untouched until loaded, and weights stream in one
    tensor at a time (read on the CPU, copied into place): peak memory stays
    near the final weights' size, and a GPU model never exists on the CPU.

    Under tensor parallelism (pagoda.distributed's initialize_model_parallel
    called in this process) the model is this rank's shard, and the rank
    reads only its slices of a safetensors checkpoint.

    quantization="gguf" keeps a GGUF file's Q4_0/Q4_1/Q8_0/Q4_K/Q6_K matrices packed
    (the CPU's packed kernels multiply them) on one rank; under tensor
    parallelism they are dequantized, since the packed rows are not split.
    "gguf_int8" packs them as "gguf" and has them multiply
    inputs rounded to int8 (see quantize_packed_inputs).
    "int8" requantizes every linear weight and the LM head to int8 once
    loaded (layers/int8.py; GGUF blocks are read packed, then decoded one
    matrix at a time).
    "fp8" quantizes the linear layers' weights to float8 once they are
    loaded (each rank its own shard); None dequantizes everything to dtype."""
    model = os.fspath(model)
    load_format = resolve_load_format(model, load_format, gguf_file)
    if load_format == "safetensors":
        weights = safetensors_weights_iterator(safetensors_files(model), dtype)
    elif load_format == "gguf":
        packing = quantization in ("gguf", "gguf_int8", "int8")
        packed = packing and get_tensor_model_parallel_world_size() == 1
        if packing and not packed:
            logger.info("GGUF weights dequantized to %s: packed weights run on one rank", dtype)
        weights = gguf_weights_iterator(_gguf_path(model, gguf_file), hf_config, dtype, packed=packed)
    else:
        weights = None
    with torch.device(device if device is not None else torch.get_default_device()):
        instance = get_model_class(hf_config)(hf_config, dtype)
    if weights is None:
        initialize_dummy_weights(instance)
    else:
        instance.load_weights(weights)
    if quantization == "gguf_int8":
        logger.info("GGUF weights: %d packed matrices multiply int8 inputs", quantize_packed_inputs(instance))
    if quantization == "int8":
        quantized, kept = quantize_int8_weights(instance)
        logger.info("int8 weights: %d matrices requantized%s", quantized,
                    f", {kept} kept in fp32 (in_features not multiples of 32)" if kept else "")
    if quantization == "fp8":
        quantized, kept = quantize_linear_weights(instance)
        logger.info("FP8 weights: %d linear layers quantized%s", quantized,
                    f", {kept} kept in {dtype} (dimensions not multiples of {ALIGNMENT})" if kept else "")
    return_freed_heap()  # the weights' temporaries
    return instance.eval().requires_grad_(False)
