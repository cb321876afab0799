"""Repository rule: hipcc from ROCM_PATH (default /opt/rocm, then PATH).

Writes @local_config_rocm/defs.bzl with HIPCC (empty when none was found) and
HIP_ARCHS: those of the wanted AMD targets that this hipcc can compile for
(Debian's hipcc 5.2 knows gfx90a but not gfx942).
Re-run when the toolchain changes (installed, upgraded, removed: PAGODA_TOOLCHAIN_ID
from tools/toolchain_identity.sh) and by `tools/bazel sync --configure`.
"""

load("//tools:kernel_sources.bzl", "HIP_ARCHS")

def _find_hipcc(ctx):
    rocm_path = ctx.os.environ.get("ROCM_PATH", "/opt/rocm")
    candidate = ctx.path(rocm_path + "/bin/hipcc")
    if candidate.exists:
        return candidate
    return ctx.which("hipcc")

def _rocm_configure_impl(ctx):
    hipcc = _find_hipcc(ctx)
    archs = []
    if hipcc:
        ctx.file("probe.hip", "#include <hip/hip_runtime.h>\n__global__ void probe(float* x) { x[0] = 1.0f; }\n")
        for arch in HIP_ARCHS:
            result = ctx.execute(
                [str(hipcc), "--offload-arch=" + arch, "-x", "hip", "-c", "probe.hip", "-o", "probe.o"],
                environment = {"HIP_PLATFORM": "amd"},
            )
            if result.return_code == 0:
                archs.append(arch)
        ctx.delete("probe.hip")
        ctx.delete("probe.o")
    ctx.file("BUILD.bazel", "")
    ctx.file("defs.bzl", "\n".join([
        '"""The hipcc found by rocm_configure and the AMD targets it supports."""',
        "HIPCC = %r" % (str(hipcc) if hipcc else ""),
        "HIP_ARCHS = %r" % archs,
        "",
    ]))

rocm_configure = repository_rule(
    implementation = _rocm_configure_impl,
    environ = ["ROCM_PATH", "PATH", "PAGODA_TOOLCHAIN_ID"],
    configure = True,
    local = True,
)
