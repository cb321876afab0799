"""py_test wrappers: pytest files run under the configured venv interpreter.

Every test carries hardware tags (cpu, avx2, avx512, cuda, rocm, multi_gpu)
that .bazelrc's --test_tag_filters select per config.
"""

load("//tools:kernel_sources.bzl", "CPU_ISA_COPTS")

_RUNNER = "//tests:pytest_runner.py"

def pagoda_py_test(name, srcs, deps = [], args = [], **kwargs):
    """One pytest file (srcs[0]) as a py_test."""
    native.py_test(
        name = name,
        srcs = srcs + [_RUNNER],
        main = _RUNNER,
        args = ["$(location %s)" % srcs[0]] + args,
        deps = deps,
        python_version = "PY3",
        **kwargs
    )

def pagoda_py_tests(tests, srcs = [], **kwargs):
    """pagoda_py_test for each name in `tests` (file <name>.py), each also
    given the shared `srcs` (conftest.py, helpers) and the same attributes."""
    for test in tests:
        pagoda_py_test(name = test, srcs = [test + ".py"] + srcs, **kwargs)

# Kernel tables that are a build with some kernels swapped for code of a later
# extension (cc/cpu_dispatch.cc), and the build each belongs to.
_CPU_ISA_VARIANTS = {"avx512_bf16": "avx512"}

def pagoda_cpu_isa_test(name, srcs, tags = [], env = {}, variants = [], **kwargs):
    """One py_test per CPU kernel build (<name>_avx2, <name>_avx512) and per
    table of `variants` (e.g. <name>_avx512_bf16, tagged as its build), each
    forcing that one (see tests/ops/conftest.py); one the CPU cannot run is
    skipped by the test itself."""
    isas = {isa: isa for isa in CPU_ISA_COPTS.keys()}
    isas.update({variant: _CPU_ISA_VARIANTS[variant] for variant in variants})
    for isa, build in isas.items():
        pagoda_py_test(
            name = "%s_%s" % (name, isa),
            srcs = srcs,
            env = dict(env, PAGODA_TEST_CPU_ISA = isa),
            tags = tags + ["cpu", build],
            **kwargs
        )
