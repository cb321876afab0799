"""The kernel library records the torch it was built for and refuses another."""

import shutil
import pytest
import torch

from pagoda import _native, ops


def test_build_info_matches_running_torch():
    info = _native.read_build_info(_native.find_library("_C"))
    assert info["torch"] == torch.__version__.split("+")[0]
    assert info["cxx11_abi"] == str(int(torch._C._GLIBCXX_USE_CXX11_ABI))
    assert ops._C.build_info() == "PAGODA_BUILD_INFO{torch=%s;cxx11_abi=%s}" % (info["torch"], info["cxx11_abi"])


def test_library_for_another_torch_is_refused_in_one_line(tmp_path):
    library = tmp_path / "_C.so"
    shutil.copy(_native.find_library("_C"), library)
    data = library.read_bytes()
    running = torch.__version__.split("+")[0].encode()
    library.write_bytes(data.replace(b"torch=" + running + b";", b"torch=1.99.9;"))
    with pytest.raises(ImportError) as error:
        _native.check_compatible(library)
    message = str(error.value)
    assert "\n" not in message
    assert "built for torch 1.99.9" in message
    assert f"runs torch {torch.__version__}" in message
    assert "tools/bazel build //python/pagoda:all" in message
    assert "python tools/build_ext.py" in message


def test_foreign_library_is_refused(tmp_path):
    library = tmp_path / "_C.so"
    library.write_bytes(b"\x7fELF not ours")
    with pytest.raises(ImportError, match="not a Pagoda kernel library"):
        _native.check_compatible(library)


def test_cpu_isa_reporting():
    compiled = ops._C.compiled_cpu_isas()
    assert compiled and set(compiled) <= {"avx2", "avx512", "avx512_bf16"}
    assert set(ops._C.supported_cpu_isas()) <= set(compiled)
    assert ops._C.cpu_isa() in ops._C.supported_cpu_isas()

