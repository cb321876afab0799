"""Shared fixtures for the kernel tests.

`--cpu-isa=avx2|avx512` runs the whole file against one build of the CPU
kernels (Bazel makes one test target per build); a build this CPU cannot run is
skipped, not failed. The `device` fixture covers the CPU and, where torch sees
a GPU and Pagoda's CUDA ops are loaded, CUDA.
"""

import pytest
import torch

from pagoda import _native, ops


def pytest_addoption(parser):
    parser.addoption("--cpu-isa", default="", help="CPU kernel build to test (default: best available)")


@pytest.fixture(scope="session", autouse=True)
def cpu_isa(request):
    isa = request.config.getoption("--cpu-isa")
    if isa and isa not in ops._C.supported_cpu_isas():
        pytest.skip(f"this CPU cannot run the {isa} kernel build (it runs: {ops._C.supported_cpu_isas()})")
    ops._C.select_cpu_isa(isa)
    assert not isa or ops._C.cpu_isa() == isa
    return ops._C.cpu_isa()


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and _native.has_cuda_ops() else [])


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


TOLERANCES = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    # Up to two units in the last place: the kernels sum in another order than
    # torch, and rms_norm rounds twice (as Hugging Face does).
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-5),
    torch.float16: dict(rtol=2.5e-3, atol=1e-5),
}


def strided_rows(rows: int, width: int, dtype, device, pad: int = 5) -> torch.Tensor:
    """A [rows, width] view whose row stride is width + pad (not contiguous)."""
    return torch.randn(rows, width + pad, dtype=dtype, device=device)[:, :width]
