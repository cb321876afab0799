"""pybind_extension: a pybind11 module built as `<name>.so`, for `import <name>`."""

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
        **kwargs
    )
