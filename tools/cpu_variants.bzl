"""cpu_kernel_library: one set of CPU sources, one build per instruction set.

Each variant compiles the same sources with its own -m flags and
-DPAGODA_CPU_NS=<isa>, so its symbols live in pagoda::cpu::<isa> and the variants
link side by side; cc/cpu_dispatch.cc picks one at load time from cpuid. The
variants built follow the config: both by default, one under --config=avx2 or
--config=avx512 (which sets PAGODA_HAVE_<ISA> for the dispatcher).
"""

load("//tools:kernel_sources.bzl", "CPU_COPTS", "CPU_ISA_COPTS", "CPU_LINKOPTS")

def cpu_kernel_library(name, srcs, hdrs, deps = [], **kwargs):
    variants = []
    for isa, isa_copts in CPU_ISA_COPTS.items():
        variant = "%s_%s" % (name, isa)
        others = [other for other in CPU_ISA_COPTS.keys() if other != isa]
        native.cc_library(
            name = variant,
            srcs = srcs,
            hdrs = hdrs,
            copts = CPU_COPTS + isa_copts,
            linkopts = CPU_LINKOPTS,
            deps = deps,
            **kwargs
        )

        # A variant is linked in unless --config pins another one.
        variants.append(select(dict(
            [("//tools:cpu_isa_" + other, []) for other in others] +
            [("//conditions:default", [":" + variant])],
        )))
    all_variants = variants[0]
    for more in variants[1:]:
        all_variants = all_variants + more
    native.cc_library(
        name = name,
        hdrs = hdrs,
        deps = all_variants,
        defines = select(dict(
            [("//tools:cpu_isa_" + isa, ["PAGODA_HAVE_" + isa.upper()]) for isa in CPU_ISA_COPTS.keys()] +
            [("//conditions:default", ["PAGODA_HAVE_" + isa.upper() for isa in CPU_ISA_COPTS.keys()])],
        )),
        **kwargs
    )
