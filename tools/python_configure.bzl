"""Repository rule: Python, torch and pybind11 from the interpreter in PYTHON_BIN_PATH.

Asks the interpreter where its headers and libraries are, symlinks them into the
repository and writes cc_library targets plus a py_runtime toolchain, so Bazel's
py_test/py_binary run under the same interpreter that the C++ extension is built
against. Changing PYTHON_BIN_PATH, or the interpreter or torch behind it
(tools/toolchain_identity.sh, through PAGODA_TOOLCHAIN_ID), re-runs the rule;
so does `tools/bazel sync --configure`.
"""

_QUERY = """
import json, os, sys, sysconfig
info = {"python": sys.executable, "python_include": sysconfig.get_paths()["include"],
        "python_version": "%d.%d" % sys.version_info[:2]}
try:
    import torch, torch.utils.cpp_extension as ext
    info["torch_version"] = torch.__version__
    info["torch_cxx11_abi"] = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    info["torch_include"] = ext.include_paths()[0]
    info["torch_lib"] = os.path.join(os.path.dirname(torch.__file__), "lib")
    info["torch_cuda"] = torch.version.cuda or ""
except ImportError as error:
    info["error"] = "torch: %s" % error
try:
    import pybind11
    info["pybind11_include"] = pybind11.get_include()
except ImportError as error:
    info["error"] = "pybind11: %s" % error
print(json.dumps(info))
"""

def _python_configure_impl(ctx):
    python = ctx.os.environ.get("PYTHON_BIN_PATH", "")
    if not python:
        python = str(ctx.which("python3") or "")
    if not python:
        fail("python_configure: no interpreter; run Bazel through tools/bazel or set PYTHON_BIN_PATH")
    result = ctx.execute([python, "-c", _QUERY])
    if result.return_code != 0:
        fail("python_configure: %s failed: %s" % (python, result.stderr))
    info = json.decode(result.stdout)
    if "error" in info:
        fail("python_configure: %s cannot import %s; run Bazel through tools/bazel (it installs requirements.txt)" % (python, info["error"]))

    ctx.symlink(info["python_include"], "python_include")
    ctx.symlink(info["torch_include"], "torch_include")
    ctx.symlink(info["torch_lib"], "torch_lib")
    ctx.symlink(info["pybind11_include"], "pybind11_include")

    ctx.template("BUILD.bazel", ctx.attr._build_template, {
        "%{python}": info["python"],
        "%{torch_lib}": info["torch_lib"],
        "%{cxx11_abi}": str(info["torch_cxx11_abi"]),
        "%{torch_cuda_linkopts}": repr(["-lc10_cuda"] if info["torch_cuda"] else []),
    })
    ctx.file("build_info.bzl", "\n".join([
        '"""Facts about the configured interpreter, for BUILD files and tests."""',
        "PYTHON_BIN = %r" % info["python"],
        "PYTHON_VERSION = %r" % info["python_version"],
        "TORCH_VERSION = %r" % info["torch_version"],
        "TORCH_CXX11_ABI = %d" % info["torch_cxx11_abi"],
        "TORCH_CUDA = %r" % info["torch_cuda"],
        "",
    ]))

python_configure = repository_rule(
    implementation = _python_configure_impl,
    environ = ["PYTHON_BIN_PATH", "PAGODA_TOOLCHAIN_ID"],
    configure = True,
    local = True,
    attrs = {
        "_build_template": attr.label(default = Label("//third_party/python:BUILD.tpl")),
    },
)
