"""The allowed arrows between Pagoda's parts (DESIGN.md), checked on every
import in the sources, function-level ones included: the engine and the
scheduler import no torch and no model code (the workers behind the executor
own the device), the model code knows nothing of the engine, and the leaves
(config, sampling parameters, outputs, logging) import no part above them."""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "python" / "pagoda"
ABOVE_LEAVES = ["pagoda.core", "pagoda.engine", "pagoda.executor", "pagoda.worker", "pagoda.model_executor",
                "pagoda.entrypoints", "pagoda.ops", "pagoda._native", "pagoda.distributed"]
# part (a subpackage or module of pagoda) -> modules it must never import
FORBIDDEN = {
    "core": ["torch", "pagoda.engine", "pagoda.executor", "pagoda.worker", "pagoda.model_executor",
             "pagoda.entrypoints", "pagoda.ops", "pagoda._native", "pagoda.distributed"],
    "engine": ["torch", "pagoda.worker", "pagoda.model_executor", "pagoda.entrypoints", "pagoda.ops",
               "pagoda._native", "pagoda.distributed"],
    "executor": ["pagoda.engine", "pagoda.entrypoints", "pagoda.model_executor"],
    "worker": ["pagoda.engine", "pagoda.executor", "pagoda.entrypoints"],
    "model_executor": ["pagoda.engine", "pagoda.executor", "pagoda.worker", "pagoda.entrypoints", "pagoda.core"],
    "distributed": ["pagoda.engine", "pagoda.executor", "pagoda.worker", "pagoda.entrypoints", "pagoda.core",
                    "pagoda.model_executor"],
    "ops.py": ["pagoda.engine", "pagoda.executor", "pagoda.worker", "pagoda.entrypoints", "pagoda.core"],
    "sampling_params.py": ABOVE_LEAVES + ["torch"],
    "outputs.py": ABOVE_LEAVES + ["torch"],
    "logger.py": ABOVE_LEAVES + ["torch"],
}
# Exceptions: the tensor-parallel divisibility rule is plain Python, checked
# by the engine before it starts workers.
ALLOWED = {"engine": ["pagoda.distributed.utils"]}


def imports(path: pathlib.Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
            if node.module == "pagoda":  # from pagoda import ops
                found += [(node.lineno, f"pagoda.{alias.name}") for alias in node.names]
    return found


def sources(part: str) -> list[pathlib.Path]:
    path = PACKAGE / part
    return [path] if part.endswith(".py") else sorted(path.rglob("*.py"))


@pytest.mark.parametrize("part", sorted(FORBIDDEN))
def test_no_forbidden_import(part):
    bad = []
    for path in sources(part):
        for line, module in imports(path):
            if module in ALLOWED.get(part, ()):
                continue
            if any(module == f or module.startswith(f + ".") for f in FORBIDDEN[part]):
                bad.append(f"{path.relative_to(PACKAGE)}:{line} imports {module}")
    assert not bad, f"{part} may not import these:\n" + "\n".join(bad)
