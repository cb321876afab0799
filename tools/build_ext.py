#!/usr/bin/env python3
"""Bazel-free build of Pagoda's kernels, for GPU hosts without Bazel.

Reads the same source list and flags as Bazel (tools/kernel_sources.bzl) and
builds, against the torch of the interpreter running it:
  python/pagoda/_C.so         CPU kernels (AVX2 + AVX512 builds), op schemas, pybind11 module
  python/pagoda/_cuda_ops.so  CUDA kernels and their torch.ops registration (when CUDA is found)

  python tools/build_ext.py [--no-cuda] [--cuda-archs sm_90a] [--jobs N]

PAGODA_CXX picks the C++ compiler (default: c++ on PATH).

Kernel objects are compiled directly (each CPU source once per instruction set,
each .cu by nvcc); torch.utils.cpp_extension compiles the torch-facing glue and
links the libraries.
"""

from __future__ import annotations

import argparse
import ast
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def read_sources() -> dict:
    """The assignments of tools/kernel_sources.bzl, as Python values."""
    tree = ast.parse((ROOT / "tools" / "kernel_sources.bzl").read_text())
    return {
        node.targets[0].id: ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
    }


def nvcc_arch_flags(archs: list[str]) -> list[str]:
    """SASS for every arch plus PTX of the last (as tools/gpu_library.bzl)."""
    numbers = [arch[len("sm_") :] for arch in archs]
    flags = [f"-gencode=arch=compute_{n},code=sm_{n}" for n in numbers]
    return flags + [f"-gencode=arch=compute_{numbers[-1]},code=compute_{numbers[-1]}"]


def compile_all(jobs: list[tuple[list[str], Path]], workers: int) -> list[Path]:
    def run(job):
        command, output = job
        output.parent.mkdir(parents=True, exist_ok=True)
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        if result.returncode != 0:
            raise SystemExit(f"build_ext: failed: {' '.join(command)}\n{result.stdout}{result.stderr}")
        return output

    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(run, jobs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-cuda", action="store_true", help="build only the CPU library")
    parser.add_argument("--cuda-archs", default=None, help="comma-separated, e.g. sm_90a (default: kernel_sources.bzl)")
    parser.add_argument("--build-dir", type=Path, default=ROOT / "build" / "ext")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()

    import pybind11
    import torch
    from torch.utils import cpp_extension

    src = read_sources()
    build = args.build_dir.resolve()
    # The system compiler by default, not $CXX: the H200 image's CXX
    # (/opt/gcc/bin/g++) links libstdc++ statically, and a second, private
    # libstdc++ inside the extension crashes on its first iostream use.
    cxx = os.environ.get("PAGODA_CXX") or shutil.which("c++") or "c++"
    os.environ["CXX"] = cxx  # torch.utils.cpp_extension compiles and links with it
    started = time.time()
    print(f"build_ext: torch {torch.__version__} ({sys.executable}), {cxx}, into {build}", flush=True)

    # CPU kernels: every source once per instruction set.
    jobs = []
    for isa, isa_copts in src["CPU_ISA_COPTS"].items():
        for source in src["CPU_KERNEL_SRCS"]:
            output = build / "cpu" / isa / (Path(source).stem + ".o")
            jobs.append(([cxx, *src["CPU_COPTS"], *isa_copts, "-fPIC", f"-I{ROOT}", "-c", source, "-o", str(output)], output))
    cpu_objects = compile_all(jobs, args.jobs)
    have_isas = [f"-DPAGODA_HAVE_{isa.upper()}" for isa in src["CPU_ISA_COPTS"]]

    package = ROOT / "python" / "pagoda"
    cpp_extension.load(
        name="_C",
        sources=[str(ROOT / s) for s in src["PYBIND_MODULE_SRCS"] + src["CPU_DISPATCH_SRCS"] + src["TORCH_OPS_SRCS"] + src["BUILD_INFO_SRCS"]],
        extra_cflags=[*src["CPU_COPTS"], *have_isas],
        # pybind11's own headers first: module.cc uses them, not torch's copy.
        extra_include_paths=[pybind11.get_include(), str(ROOT)],
        extra_ldflags=[*map(str, cpu_objects), *src["CPU_LINKOPTS"]],
        build_directory=str(_fresh(build / "_C")),
        is_python_module=False,
        verbose=False,
    )
    shutil.copy(build / "_C" / "_C.so", package / "_C.so")
    print(f"build_ext: {package / '_C.so'} ({', '.join(src['CPU_ISA_COPTS'])})", flush=True)

    if args.no_cuda:
        return
    if cpp_extension.CUDA_HOME is None or not torch.version.cuda:
        print("build_ext: no CUDA toolkit or CPU-only torch: skipping _cuda_ops.so (pass --no-cuda to silence)")
        return
    nvcc = str(Path(cpp_extension.CUDA_HOME) / "bin" / "nvcc")
    archs = args.cuda_archs.split(",") if args.cuda_archs else src["CUDA_ARCHS"]
    jobs = []
    for source in src["GPU_KERNEL_SRCS"]:
        output = build / "cuda" / (Path(source).stem + ".o")
        jobs.append(([nvcc, *src["NVCC_COPTS"], *nvcc_arch_flags(archs), f"-I{ROOT}", "-c", source, "-o", str(output)], output))
    gpu_objects = compile_all(jobs, args.jobs)
    cpp_extension.load(
        name="_cuda_ops",
        sources=[str(ROOT / s) for s in src["CUDA_OPS_SRCS"] + src["BUILD_INFO_SRCS"]],
        extra_cflags=["-O3", "-std=c++17"],
        extra_include_paths=[str(ROOT)],
        extra_ldflags=[*map(str, gpu_objects), f"-L{Path(cpp_extension.CUDA_HOME) / 'lib64'}", "-lcudart"],
        build_directory=str(_fresh(build / "_cuda_ops")),
        with_cuda=True,
        is_python_module=False,
        verbose=False,
    )
    shutil.copy(build / "_cuda_ops" / "_cuda_ops.so", package / "_cuda_ops.so")
    print(f"build_ext: {package / '_cuda_ops.so'} ({', '.join(archs)}) in {time.time() - started:.0f} s", flush=True)


def _fresh(path: Path) -> Path:
    """A build folder without its old library: the prebuilt kernel objects
    reach the link as flags, so ninja would not relink when only they changed."""
    path.mkdir(parents=True, exist_ok=True)
    for library in path.glob("*.so"):
        library.unlink()
    return path


if __name__ == "__main__":
    main()
