"""pybind_extension: a pybind11 module built as `<name>.so`, for `import <name>`."""

# The extensions' only RUNPATH: torch's libraries where a wheel install puts
# them (site-packages/pagoda/X.so beside site-packages/torch/lib). They are
# normally found by soname, torch being imported first (pagoda._native); the
# configured interpreter's torch/lib is never written into a shipped .so.
TORCH_EXTENSION_LINKOPTS = ["-Wl,-rpath,$$ORIGIN/../torch/lib"]

def pybind_extension(name, srcs, deps = [], **kwargs):
    """srcs hold the PYBIND11_MODULE; deps are linked in whole (their static
    registrations, e.g. TORCH_LIBRARY blocks, must survive the link)."""
    native.cc_library(
        name = name + "_module",
        srcs = srcs,
        # Hidden visibility keeps this module's pybind11 symbols apart from
        # torch's own pybind11 copy in the same process.
        copts = ["-fvisibility=hidden", "-std=c++17"],
        alwayslink = True,
        deps = deps + [
            "@local_config_python//:pybind11",
            "@local_config_python//:python_headers",
        ],
    )
    native.cc_binary(
        name = name + ".so",
        linkshared = True,
        linkstatic = True,
        deps = [":" + name + "_module"],
        linkopts = TORCH_EXTENSION_LINKOPTS + kwargs.pop("linkopts", []),
        **kwargs
    )
