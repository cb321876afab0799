"""pagoda_part: a py_library that is one part of a package (DESIGN.md's parts:
core, engine, worker, ...), whose deps are the only other parts it may import.

Building the part runs tools/check_imports.py over its sources (a validation
action: it runs wherever the part is built, as a dep of a test or of the wheel
too): an import of a module of the package that is neither in the part nor in
a part of its deps, or of torch where the part does not allow torch, fails the
build with file:line. Bazel refuses a cycle of deps, so the parts cannot import
each other in a circle either.
"""

load("@local_config_python//:build_info.bzl", "PYTHON_BIN")

PagodaPartInfo = provider(
    doc = "The module files of a part, for the import check of the parts above it.",
    fields = {"modules": "depset of the part's .py files and compiled extensions"},
)

def _module_files(files):
    return [f for f in files if f.extension in ("py", "so")]

def _short_path(file):
    return file.short_path

def _pagoda_part_impl(ctx):
    library = ctx.attr.library
    modules = _module_files(ctx.files.srcs + ctx.files.data)
    stamp = ctx.actions.declare_file(ctx.label.name + ".imports_ok")
    args = ctx.actions.args()
    args.add(ctx.file._checker)
    args.add_all(["--part", ctx.label.name, "--root", ctx.attr.root, "--stamp", stamp])
    if ctx.attr.torch:
        args.add("--torch")
    args.add_all(ctx.files.srcs, before_each = "--check")
    parts = [(ctx.label.name, depset(modules))] + [(dep.label.name, dep[PagodaPartInfo].modules) for dep in ctx.attr.deps]
    for part, files in parts:
        # Paths only: the check reads the part's own sources, not its deps'.
        args.add_all(files, before_each = "--module", map_each = _short_path, format_each = part + "=%s")
    ctx.actions.run(
        executable = PYTHON_BIN,
        arguments = [args],
        inputs = ctx.files.srcs + [ctx.file._checker],
        outputs = [stamp],
        mnemonic = "PagodaImports",
        progress_message = "Checking the imports of part %s" % ctx.label.name,
    )
    return [
        library[PyInfo],
        DefaultInfo(files = library[DefaultInfo].files, runfiles = library[DefaultInfo].default_runfiles),
        PagodaPartInfo(modules = depset(modules)),
        OutputGroupInfo(_validation = depset([stamp])),
    ]

_pagoda_part = rule(
    implementation = _pagoda_part_impl,
    attrs = {
        "library": attr.label(mandatory = True, providers = [PyInfo]),
        "srcs": attr.label_list(allow_files = [".py"]),
        "data": attr.label_list(allow_files = True),
        "deps": attr.label_list(providers = [PagodaPartInfo]),
        "torch": attr.bool(),
        "root": attr.string(mandatory = True),
        "_checker": attr.label(default = "//tools:check_imports.py", allow_single_file = True),
    },
)

def pagoda_part(name, srcs, deps = [], data = [], torch = False, **kwargs):
    """A py_library `name` (imports: the package's parent folder) of which
    every import is checked against `deps` (other pagoda_part targets);
    torch: whether its sources may import torch."""
    native.py_library(
        name = name + "_library",
        srcs = srcs,
        deps = deps,
        data = data,
        imports = [".."],
        visibility = ["//visibility:private"],
        **kwargs
    )
    _pagoda_part(
        name = name,
        library = ":%s_library" % name,
        srcs = srcs,
        data = data,
        deps = deps,
        torch = torch,
        root = native.package_name().rpartition("/")[0],
    )

def pagoda_parts_cover(srcs):
    """Fails unless each file of `srcs` (the package's glob of .py files) is a
    source of a part defined above: a new module must choose its part."""
    taken = {}
    for rule in native.existing_rules().values():
        if rule["kind"] == "py_library":
            for src in rule["srcs"]:
                taken[src.split(":")[-1]] = True
    missing = [src for src in srcs if src not in taken]
    if missing:
        fail("%s: in no pagoda_part: %s" % (native.package_name(), ", ".join(missing)))
