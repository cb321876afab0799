"""py_wheel: a PEP 427 wheel of py_library targets and the files they carry.

Bazel 4.2.3 runs offline without rules_python, so this small rule hands the
packages' sources and data (the built .so files included) to
tools/build_wheel.py, which writes METADATA, WHEEL, entry_points.txt and RECORD.
The wheel's file name holds the version and tags, known only when it is built,
so the output is a directory holding the one wheel.
"""

load("@local_config_python//:build_info.bzl", "PYTHON_BIN", "PYTHON_VERSION", "TORCH_VERSION")

def _archive_path(file, strip_prefix):
    path = file.short_path
    return path[len(strip_prefix):] if path.startswith(strip_prefix) else None

def _py_wheel_impl(ctx):
    files = depset(transitive = [
        depset(transitive = [dep[PyInfo].transitive_sources, dep[DefaultInfo].default_runfiles.files])
        for dep in ctx.attr.deps
    ])
    packed = {}
    for file in files.to_list():
        path = _archive_path(file, ctx.attr.strip_prefix)
        if path != None and path.split("/")[0] in ctx.attr.packages:
            packed[path] = file

    out = ctx.actions.declare_directory(ctx.label.name)
    args = ctx.actions.args()
    args.add(ctx.file._builder)
    args.add_all([
        "--name",
        ctx.attr.distribution,
        "--out-dir",
        out.path,
        "--requirements",
        ctx.file.requirements.path,
        "--torch-version",
        TORCH_VERSION,
        "--python-version",
        PYTHON_VERSION,
        "--summary",
        ctx.attr.summary,
    ])
    for entry_point in ctx.attr.console_scripts:
        args.add("--entry-point", entry_point)
    args.add_all(["%s=%s" % (path, packed[path].path) for path in sorted(packed)])
    ctx.actions.run(
        # The configured interpreter, whose tags the wheel carries.
        executable = PYTHON_BIN,
        arguments = [args],
        inputs = packed.values() + [ctx.file.requirements, ctx.file._builder],
        outputs = [out],
        mnemonic = "PyWheel",
        progress_message = "Packing the %s wheel" % ctx.attr.distribution,
    )
    return [DefaultInfo(files = depset([out]), runfiles = ctx.runfiles(files = [out]))]

py_wheel = rule(
    implementation = _py_wheel_impl,
    attrs = {
        "deps": attr.label_list(providers = [PyInfo], doc = "py_library targets to pack, with their data"),
        "distribution": attr.string(mandatory = True),
        "packages": attr.string_list(mandatory = True, doc = "top-level packages to take from the deps' files"),
        "strip_prefix": attr.string(doc = "removed from each file's workspace path (e.g. python/)"),
        "requirements": attr.label(allow_single_file = True, mandatory = True),
        "console_scripts": attr.string_list(doc = "NAME=module:function"),
        "summary": attr.string(mandatory = True),
        "_builder": attr.label(default = "//tools:build_wheel.py", allow_single_file = True),
    },
)
