"""--kv-cache-dtype: the names accepted, and which cache dtype each gives
for a model's dtype, device and quantization (a ValueError naming
kv_cache_dtype where the kernels cannot run it). Only those are read, so a
stand-in for ModelConfig does; no GPU is needed to check the CUDA rules
(those that reach the fp8 capability check are tests/engine/test_fp8.py's)."""

from types import SimpleNamespace

import pytest
import torch

from pagoda.config import CacheConfig

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


def model(dtype, device, quantization=None):
    return SimpleNamespace(torch_dtype=dtype, device=torch.device(device), quantization=quantization)


@pytest.mark.parametrize("value", ["float16", "fp16", "bf16", "half", "int8", "", None, "BFLOAT16"])
def test_unknown_names_are_refused(value):
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, bfloat16, float32, fp8, fp8_e4m3"):
        CacheConfig(kv_cache_dtype=value)


@pytest.mark.parametrize("dtype", [F32, BF16, F16])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_auto_is_the_model_dtype(dtype, device):
    assert CacheConfig().kv_cache_torch_dtype(model(dtype, device)) == dtype
    assert CacheConfig().kv_cache_torch_dtype(model(dtype, device, "gguf")) == dtype


def test_auto_is_bfloat16_under_gguf_int8():
    """(gguf_int8 is fp32 on the CPU only: ModelConfig refuses the rest.)"""
    int8 = model(F32, "cpu", "gguf_int8")
    assert CacheConfig().kv_cache_torch_dtype(int8) == BF16
    assert CacheConfig(kv_cache_dtype="float32").kv_cache_torch_dtype(int8) == F32


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_float32(device):
    assert CacheConfig(kv_cache_dtype="float32").kv_cache_torch_dtype(model(F32, device)) == F32
    with pytest.raises(ValueError, match="kv_cache_dtype='float32' needs a float32 model, this one runs in bfloat16"):
        CacheConfig(kv_cache_dtype="float32").kv_cache_torch_dtype(model(BF16, device))


@pytest.mark.parametrize("dtype,device", [(F32, "cpu"), (BF16, "cpu"), (BF16, "cuda")])
def test_bfloat16(dtype, device):
    assert CacheConfig(kv_cache_dtype="bfloat16").kv_cache_torch_dtype(model(dtype, device)) == BF16


# fp16 activations have no bf16-cache kernel anywhere; CUDA's kernels read
# the model's dtype (or fp8) only.
@pytest.mark.parametrize("dtype,device", [(F16, "cpu"), (F32, "cuda"), (F16, "cuda")])
def test_bfloat16_refused_where_no_kernel_reads_it(dtype, device):
    name = str(dtype).removeprefix("torch.")
    with pytest.raises(ValueError, match=f"kv_cache_dtype='bfloat16' needs .* runs in {name} on {device}"):
        CacheConfig(kv_cache_dtype="bfloat16").kv_cache_torch_dtype(model(dtype, device))
