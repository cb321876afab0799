"""Loads Pagoda's compiled kernels: pagoda._C (CPU kernels and the op schemas,
torch.ops.pagoda.*) and, beside a CUDA build of torch, _cuda_ops.so.

Each library records the torch version and C++ ABI it was built against (see
cc/build_info.cc). They are checked before loading, because a library built for
another torch fails inside the dynamic linker with an unhelpful
"undefined symbol" error.

torch is imported where a function needs it: finding the libraries
(find_library) takes none, so that config.probable_device_type can ask
before anything imports torch.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

# Not resolve(): under Bazel the sources are symlinks into the checkout, while
# the built libraries sit only beside the symlinks in the runfiles tree.
_PACKAGE_DIR = Path(os.path.abspath(__file__)).parent
_BUILD_INFO = re.compile(rb"PAGODA_BUILD_INFO\{torch=([^;}]*);cxx11_abi=(\d)\}")
_REBUILD_HINT = (
    "rebuild it against this torch: `tools/bazel build //python/pagoda:all` "
    "(or, on a host without Bazel, `python tools/build_ext.py`)"
)


def read_build_info(path: Path) -> dict[str, str]:
    """The torch version and CXX11 ABI recorded in a Pagoda shared object."""
    match = _BUILD_INFO.search(Path(path).read_bytes())
    if match is None:
        raise ImportError(f"{path} is not a Pagoda kernel library (no build info found); {_REBUILD_HINT}")
    return {"torch": match.group(1).decode(), "cxx11_abi": match.group(2).decode()}


def check_compatible(path: Path) -> None:
    """Raises ImportError in one line if `path` was built for another torch."""
    import torch

    info = read_build_info(path)
    running = torch.__version__.split("+")[0]
    abi = str(int(torch._C._GLIBCXX_USE_CXX11_ABI))
    if info["torch"] != running or info["cxx11_abi"] != abi:
        raise ImportError(
            f"{path.name} was built for torch {info['torch']} (C++11 ABI {info['cxx11_abi']}) but this process "
            f"runs torch {torch.__version__} (C++11 ABI {abi}); {_REBUILD_HINT}"
        )


def find_library(stem: str) -> Path | None:
    """The built library `stem` (e.g. "_C", "_cuda_ops") beside this package, if any."""
    for candidate in sorted(_PACKAGE_DIR.glob(stem + "*.so")):
        return candidate
    return None


@functools.cache
def load():
    """Imports pagoda._C (and the CUDA ops where they apply), once; returns
    pagoda._C."""
    import torch

    path = find_library("_C")
    if path is None:
        raise ImportError(f"pagoda._C is not built in {_PACKAGE_DIR}; build it: {_REBUILD_HINT.split(': ', 1)[1]}")
    check_compatible(path)
    from pagoda import _C

    _C.select_cpu_isa(os.environ.get("PAGODA_CPU_ISA", ""))
    if torch.cuda.is_available():
        cuda_ops = find_library("_cuda_ops")
        if cuda_ops is not None:
            check_compatible(cuda_ops)
            torch.ops.load_library(str(cuda_ops))
    return _C


@functools.cache
def has_kernel(op: str, device: str = "cuda") -> bool:
    """Whether torch.ops.pagoda.<op> has an implementation for `device`
    ("cpu", "cuda") in this process. Cached: load() registers every kernel
    there is, and the lookup costs about 50 us, which the sampler would pay
    each step."""
    import torch

    load()
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"pagoda::{op}", device.upper())


def has_cuda_ops() -> bool:
    """Whether torch.ops.pagoda.* have CUDA implementations in this process."""
    return has_kernel("rms_norm")
