"""Which device the engine runs on: "auto" takes CUDA only where torch sees a
GPU and Pagoda's CUDA kernels are loaded; "cuda" insists, with an error
saying what is missing; anything else is refused. GPU-only settings are
validated everywhere. probable_device_type (the offline LLM's guess before
it imports torch) agrees with it here."""

import pytest
import torch

from pagoda import _native
from pagoda.config import CacheConfig, probable_device_type, resolve_device

CUDA = torch.cuda.is_available() and _native.has_cuda_ops()


def test_auto_and_cpu():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if CUDA else "cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_cuda_without_a_gpu_says_why():
    with pytest.raises(ValueError, match="device='cuda' but torch .* sees no CUDA GPU"):
        resolve_device("cuda")


@pytest.mark.parametrize("device", ["tpu", "cuda:1", torch.device("cuda", 1), "", None])
def test_unknown_devices_are_refused(device):
    with pytest.raises(ValueError, match="device must be one of"):
        resolve_device(device)
    with pytest.raises(ValueError, match="device must be one of"):
        probable_device_type(device)


def test_the_guess_without_torch_agrees_with_torch(monkeypatch):
    assert probable_device_type("auto") == resolve_device("auto").type
    assert probable_device_type("cpu") == probable_device_type(torch.device("cpu")) == "cpu"
    assert probable_device_type("cuda") == "cuda"  # insisted on: the core says what is missing
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert probable_device_type("auto") == "cpu"


@pytest.mark.parametrize("value", [0, -0.5, 1.01, "0.9", True])
def test_gpu_memory_utilization_is_checked(value):
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        CacheConfig(gpu_memory_utilization=value)
    assert CacheConfig(gpu_memory_utilization=1).gpu_memory_utilization == 1
