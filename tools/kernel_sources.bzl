"""The one list of kernel sources and compiler flags.

Bazel loads this file (cc/BUILD.bazel, cuda/BUILD.bazel, python/pagoda/BUILD.bazel)
and the Bazel-free builder for GPU hosts (tools/build_ext.py) reads it as Python
literals, so both build the very same sources with the same flags. Keep it plain:
assignments of strings, lists and dicts only. Paths are relative to the
repository root.
"""

# CPU kernels: no torch headers; each is compiled once per instruction set.
CPU_KERNEL_SRCS = [
    "cc/cpu/activation.cc",
    "cc/cpu/attention.cc",
    "cc/cpu/cache.cc",
    "cc/cpu/gguf.cc",
    "cc/cpu/linear.cc",
    "cc/cpu/norm.cc",
    "cc/cpu/rotary.cc",
    "cc/cpu/sampling.cc",
]

CPU_KERNEL_HDRS = [
    "cc/cpu/gguf_panel.inc",
    "cc/cpu/kernels.h",
    "cc/cpu/linear_tiles.inc",
    "cc/cpu/vec.h",
]

CPU_COPTS = [
    "-O3",
    "-std=c++17",
    "-fopenmp",
    "-fno-math-errno",
]

# Per instruction set: the flags, and the namespace its symbols live in.
CPU_ISA_COPTS = {
    "avx2": ["-mavx2", "-mfma", "-mf16c", "-DPAGODA_CPU_NS=avx2"],
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx2", "-mfma", "-mf16c", "-DPAGODA_CPU_NS=avx512"],
}

CPU_LINKOPTS = ["-fopenmp"]

# The torch-facing C++ glue (at::Tensor checks -> kernel arguments,
# TORCH_LIBRARY registration) and the pybind11 module around it.
CPU_DISPATCH_SRCS = ["cc/cpu_dispatch.cc"]

TORCH_OPS_SRCS = ["cc/torch_ops.cc"]

# Linked into every shared object: the torch version it was built against.
BUILD_INFO_SRCS = ["cc/build_info.cc"]

PYBIND_MODULE_SRCS = ["cc/module.cc"]

# GPU kernels: raw pointers + stream, no torch headers; nvcc builds them for
# CUDA, hipcc (through cuda/portability.h) for ROCm.
GPU_KERNEL_SRCS = [
    "cuda/activation.cu",
    "cuda/attention.cu",
    "cuda/cache.cu",
    "cuda/norm.cu",
    "cuda/rope_and_cache.cu",
    "cuda/rotary.cu",
    "cuda/sampling.cu",
]

GPU_KERNEL_HDRS = [
    "cuda/kernels.h",
    "cuda/portability.h",
]

NVCC_COPTS = [
    "-O3",
    "-std=c++17",
    "-Xcompiler=-fPIC",
]

# SASS for each of these, plus PTX of the last one for newer GPUs.
CUDA_ARCHS = ["sm_80", "sm_90a"]

# AMD targets to build; tools/rocm_configure.bzl keeps those that the local
# hipcc knows.
HIP_ARCHS = ["gfx90a", "gfx942"]

HIPCC_COPTS = [
    "-O3",
    "-std=c++17",
    "-fPIC",
]

# The CUDA registration of the ops (TORCH_LIBRARY_IMPL for the CUDA key).
CUDA_OPS_SRCS = ["cc/cuda_ops.cc"]
