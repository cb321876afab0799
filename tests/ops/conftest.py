"""Shared fixtures for the kernel tests.

`--cpu-isa=avx2|avx512|avx512_bf16` (or PAGODA_TEST_CPU_ISA, which Bazel sets:
one test target per build) runs the whole file against one build of the CPU
kernels (avx512_bf16: the AVX512 build with its bf16 linear on VDPBF16PS); a
build this CPU cannot run is skipped, not failed. The `device` fixture covers the CPU and, where torch sees
a GPU and Pagoda's CUDA ops are loaded, CUDA.
"""

import os

import pytest
import torch

from pagoda import _native, ops


def pytest_addoption(parser):
    parser.addoption("--cpu-isa", default="", help="CPU kernel build to test (default: best available)")


@pytest.fixture(scope="session", autouse=True)
def cpu_isa(request):
    isa = request.config.getoption("--cpu-isa") or os.environ.get("PAGODA_TEST_CPU_ISA", "")
    if isa and isa not in ops._C.supported_cpu_isas():
        pytest.skip(f"this CPU cannot run the {isa} kernel build (it runs: {ops._C.supported_cpu_isas()})")
    ops._C.select_cpu_isa(isa)
    assert not isa or ops._C.cpu_isa() == isa
    return ops._C.cpu_isa()


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and _native.has_cuda_ops() else [])


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


@pytest.fixture(autouse=True)
def seed():
    """Fixed random inputs: a failure reproduces."""
    torch.manual_seed(0)

