"""Repository rule: the CUDA toolkit at CUDA_PATH (default /usr/local/cuda).

Writes @local_config_cuda with cc_library targets for the CUDA headers and the
static runtime, and defs.bzl with NVCC (empty when no nvcc was found, so a build
without --config=cuda works on any machine and --config=cuda fails clearly).
Re-run when the toolchain changes (installed, upgraded, removed: PAGODA_TOOLCHAIN_ID
from tools/toolchain_identity.sh) and by `tools/bazel sync --configure`.
"""

def _cuda_configure_impl(ctx):
    cuda_path = ctx.os.environ.get("CUDA_PATH", "/usr/local/cuda")
    nvcc = ctx.path(cuda_path + "/bin/nvcc")
    found = nvcc.exists
    version = ""
    if found:
        ctx.symlink(cuda_path + "/include", "cuda_include")
        lib = cuda_path + "/lib64"
        if not ctx.path(lib).exists:
            lib = cuda_path + "/lib"
        ctx.symlink(lib, "cuda_lib")
        result = ctx.execute([str(nvcc), "--version"])
        for line in result.stdout.splitlines():
            if "release" in line:
                version = line.split("release")[1].split(",")[0].strip()
        ctx.file("BUILD.bazel", """
package(default_visibility = ["//visibility:public"])

cc_library(
    name = "cuda_headers",
    hdrs = glob(["cuda_include/**"]),
    includes = ["cuda_include"],
)

cc_library(
    name = "cudart_static",
    srcs = ["cuda_lib/libcudart_static.a"],
    linkopts = ["-ldl", "-lpthread", "-lrt"],
    deps = [":cuda_headers"],
)
""")
    else:
        ctx.file("BUILD.bazel", """
package(default_visibility = ["//visibility:public"])

cc_library(name = "cuda_headers")

cc_library(name = "cudart_static")
""")
    ctx.file("defs.bzl", "\n".join([
        '"""The CUDA toolkit found by cuda_configure."""',
        "CUDA_PATH = %r" % cuda_path,
        "NVCC = %r" % (str(nvcc) if found else ""),
        "CUDA_VERSION = %r" % version,
        "",
    ]))

cuda_configure = repository_rule(
    implementation = _cuda_configure_impl,
    environ = ["CUDA_PATH", "PAGODA_TOOLCHAIN_ID"],
    configure = True,
    local = True,
)
