"""cuda_library (nvcc) and hip_library (hipcc): GPU sources -> a cc_library.

Both compile .cu files that include no torch headers into position-independent
objects and wrap them in a cc_library (alwayslink) that C++ glue and
cc_binary(linkshared) targets depend on. The arch lists come from the config:
CUDA from --define=cuda_archs=sm_80,sm_90a (default: CUDA_ARCHS in
kernel_sources.bzl, plus PTX of the last), ROCm from the targets the local hipcc
supports (HIP_ARCHS in @local_config_rocm).
"""

load("@bazel_tools//tools/cpp:toolchain_utils.bzl", "find_cpp_toolchain")
load("@local_config_cuda//:defs.bzl", "CUDA_PATH", "NVCC")
load("@local_config_rocm//:defs.bzl", "HIPCC", "HIP_ARCHS")
load("//tools:kernel_sources.bzl", "CUDA_ARCHS", "HIPCC_COPTS", "NVCC_COPTS")

def _compatible_with(enabled_setting):
    return select({
        enabled_setting: [],
        "//conditions:default": ["//tools:unavailable"],
    })

def requires_cuda():
    """target_compatible_with for targets built only under --config=cuda."""
    return _compatible_with("//tools:cuda_enabled")

def requires_rocm():
    """target_compatible_with for targets built only under --config=rocm."""
    return _compatible_with("//tools:rocm_enabled")

def _nvcc_arch_flags(ctx):
    archs = ctx.var.get("cuda_archs", ",".join(CUDA_ARCHS)).split(",")
    flags = []
    for arch in archs:
        number = arch[len("sm_"):]
        flags.append("-gencode=arch=compute_%s,code=sm_%s" % (number, number))
    last = archs[-1][len("sm_"):]
    flags.append("-gencode=arch=compute_%s,code=compute_%s" % (last, last))
    return flags

def _command(ctx):
    """Returns (executable, flags) for this rule's GPU platform."""
    if ctx.attr.platform == "cuda":
        if not NVCC:
            fail("--config=cuda needs nvcc, but there is none at CUDA_PATH=%s: install the CUDA toolkit or set CUDA_PATH" % CUDA_PATH)
        # The host compiler by path: actions run on a fixed PATH, and the
        # path is then part of the action key.
        host_compiler = find_cpp_toolchain(ctx).compiler_executable
        return NVCC, ["-ccbin", host_compiler] + NVCC_COPTS + _nvcc_arch_flags(ctx)
    if not HIPCC:
        fail("--config=rocm needs hipcc, but none was found in ROCM_PATH or PATH: apt-get install hipcc libamdhip64-dev, or set ROCM_PATH")
    if not HIP_ARCHS:
        fail("--config=rocm: %s cannot compile for any of the wanted AMD targets" % HIPCC)
    arch_flags = ["--offload-arch=" + arch for arch in HIP_ARCHS]
    # Without HIP_PLATFORM=amd, hipcc finds nvcc and takes the NVIDIA path.
    return "/usr/bin/env", ["HIP_PLATFORM=amd", HIPCC] + HIPCC_COPTS + arch_flags + ["-x", "hip"]

def _gpu_objects_impl(ctx):
    if not ctx.attr.enabled:
        return [DefaultInfo(files = depset())]
    compiler, flags = _command(ctx)
    headers = depset(ctx.files.hdrs, transitive = [
        dep[CcInfo].compilation_context.headers
        for dep in ctx.attr.deps
    ])
    objects = []
    for src in ctx.files.srcs:
        out = ctx.actions.declare_file("_objs/%s/%s.%s.pic.o" % (ctx.label.name, src.basename, ctx.attr.platform))
        args = ctx.actions.args()
        args.add_all(flags)
        args.add_all(["-I.", "-I" + ctx.bin_dir.path])
        args.add_all(["-c", src.path, "-o", out.path])
        ctx.actions.run(
            executable = compiler,
            arguments = [args],
            inputs = depset([src], transitive = [headers]),
            outputs = [out],
            # The fixed PATH and --action_env (the toolchain versions).
            use_default_shell_env = True,
            mnemonic = "Nvcc" if ctx.attr.platform == "cuda" else "Hipcc",
            progress_message = "Compiling %s for %s" % (src.short_path, ctx.attr.platform.upper()),
        )
        objects.append(out)
    return [DefaultInfo(files = depset(objects), runfiles = ctx.runfiles(files = objects))]

_gpu_objects = rule(
    implementation = _gpu_objects_impl,
    attrs = {
        "srcs": attr.label_list(allow_files = [".cu"]),
        "hdrs": attr.label_list(allow_files = True),
        "deps": attr.label_list(providers = [CcInfo]),
        "platform": attr.string(values = ["cuda", "rocm"]),
        "enabled": attr.bool(),
        "_cc_toolchain": attr.label(default = Label("@bazel_tools//tools/cpp:current_cc_toolchain")),
    },
)

def _gpu_library(name, platform, enabled_setting, srcs, hdrs = [], deps = [], runtime_deps = [], **kwargs):
    compatible = _compatible_with(enabled_setting)
    _gpu_objects(
        name = name + "_objects",
        srcs = srcs,
        hdrs = hdrs,
        deps = deps,
        platform = platform,
        enabled = select({enabled_setting: True, "//conditions:default": False}),
        target_compatible_with = compatible,
    )
    native.cc_library(
        name = name,
        srcs = [":" + name + "_objects"],
        hdrs = hdrs,
        deps = deps + runtime_deps,
        alwayslink = True,
        target_compatible_with = compatible,
        **kwargs
    )

def cuda_library(name, srcs, hdrs = [], deps = [], **kwargs):
    """CUDA sources compiled by nvcc; built only under --config=cuda."""
    _gpu_library(
        name = name,
        platform = "cuda",
        enabled_setting = "//tools:cuda_enabled",
        srcs = srcs,
        hdrs = hdrs,
        deps = deps + ["@local_config_cuda//:cuda_headers"],
        runtime_deps = ["@local_config_cuda//:cudart_static"],
        **kwargs
    )

def hip_library(name, srcs, hdrs = [], deps = [], **kwargs):
    """The same .cu sources compiled by hipcc for AMD GPUs; only under --config=rocm."""
    _gpu_library(
        name = name,
        platform = "rocm",
        enabled_setting = "//tools:rocm_enabled",
        srcs = srcs,
        hdrs = hdrs,
        deps = deps,
        linkopts = ["-lamdhip64"],
        **kwargs
    )
