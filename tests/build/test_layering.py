"""The layering of the package: the import check that each part's build runs
(tools/check_imports.py, tools/layers.bzl; the allowed arrows are the parts'
deps in python/pagoda/BUILD.bazel) fails on a forbidden import, and no import
circle runs when the package loads."""

import ast
import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "python" / "pagoda"

_spec = importlib.util.spec_from_file_location("check_imports", ROOT / "tools" / "check_imports.py")
check_imports = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_imports)


def run_check(tmp_path, source: str, torch: bool = False):
    """The check of a part `core` (one file) that may use the part `leaves`."""
    (tmp_path / "python" / "pagoda" / "core").mkdir(parents=True)
    checked = tmp_path / "python" / "pagoda" / "core" / "scratch.py"
    checked.write_text(source)
    stamp = tmp_path / "stamp"
    status = check_imports.main([
        "--part", "core", "--root", str(tmp_path / "python"), "--stamp", str(stamp), "--check", str(checked),
        "--module", f"core={checked}", "--module", f"leaves={tmp_path}/python/pagoda/outputs.py",
    ] + (["--torch"] if torch else []))
    return status, stamp


def test_allowed_imports_pass(tmp_path):
    status, stamp = run_check(tmp_path, "import json\nfrom pagoda.outputs import RequestOutput\n"
                                        "from pagoda.core import scratch\nimport torch\n", torch=True)
    assert status == 0 and stamp.exists()


def test_forbidden_imports_fail(tmp_path, capsys):
    status, stamp = run_check(tmp_path, "import torch\n\n\ndef f():\n    from pagoda.worker.worker import Worker\n"
                                        "    from pagoda import LLM\n    from . import other\n")
    assert status == 1 and not stamp.exists()
    errors = capsys.readouterr().err
    assert "scratch.py:1 imports torch, but part core may not use torch" in errors
    assert ("scratch.py:5 imports Worker from pagoda.worker.worker, which is in none of the parts core may use "
            "(core, leaves)") in errors
    assert "scratch.py:6 imports LLM from pagoda, which is in none" in errors
    assert "scratch.py:7 imports other from pagoda.core, which is in none" in errors


def module_of(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def load_time_imports(tree: ast.Module) -> list[ast.stmt]:
    """The import statements that run when the module loads: not those in
    functions, nor under `if TYPE_CHECKING:`."""
    found, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            todo += node.orelse
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            todo += [child for child in ast.iter_child_nodes(node) if isinstance(child, ast.stmt)]
    return found


def test_no_import_circle():
    modules = {module_of(path): path for path in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in load_time_imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif node.level == 0 and node.module:
                targets |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                            for a in node.names}
        graph[name] = sorted(targets & modules.keys() - {name})

    # Depth-first; a module met again while still on the path closes a circle.
    state, circles = {}, []

    def visit(name, path):
        state[name] = "open"
        for target in graph[name]:
            if state.get(target) == "open":
                circles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert len(modules) > 50 and not circles, "import circles:\n" + "\n".join(circles)
