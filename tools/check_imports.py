"""The import check of one part of a package (tools/layers.bzl, pagoda_part):
every import of the package's modules in the part's sources, function-level
ones included, must name a module of the part itself or of a part it lists in
its deps; torch only where the part allows it. The parts' deps in the BUILD
file are thus the one description of the allowed arrows.

  check_imports.py --part NAME --root python [--torch] --stamp OUT
      --check FILE... --module PART=FILE...

--module names every module file (.py, or a compiled extension's .so) of the
part and of its direct deps, by workspace path; --check the part's own sources
to read. On a forbidden import: one line per import (file:line imports X, ...)
and exit status 1.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import PurePosixPath


def module_name(path: str, root: str) -> str | None:
    """pagoda.core.scheduler for python/pagoda/core/scheduler.py (root
    python); pagoda.core for its __init__.py; pagoda._C for _C.so or
    _C.cpython-311-x86_64-linux-gnu.so; None for other files (data)."""
    relative = PurePosixPath(path).relative_to(root)
    if relative.suffix == ".py":
        parts = relative.with_suffix("").parts
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    if relative.suffix == ".so":
        return ".".join(relative.parent.parts + (relative.name.split(".")[0],))
    return None


def imports(source: str, path: str, module: str) -> list[tuple[int, str, list[str]]]:
    """(line, what, candidates) for each import: `from a.b import c` may
    import the module a.b.c or the name c of a.b, so both are candidates."""
    found = []
    for node in ast.walk(ast.parse(source, path)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, [alias.name]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's own package
                package = module.split(".")[:len(module.split(".")) - node.level + path.endswith("__init__.py")]
                base = ".".join(package + ([base] if base else []))
            found += [(node.lineno, f"{alias.name} from {base}", [f"{base}.{alias.name}", base])
                      for alias in node.names]
    return found


def violations(part: str, torch_allowed: bool, modules: dict[str, str], sources: dict[str, str],
               root: str) -> list[str]:
    """The forbidden imports of `sources` (path -> text), one message each;
    `modules` maps every module the part may import to its part."""
    packages = {name.split(".")[0] for name in modules}
    allowed_parts = sorted(set(modules.values()))
    bad = []
    for path, source in sorted(sources.items()):
        for line, what, candidates in imports(source, path, module_name(path, root)):
            top = candidates[0].split(".")[0]
            if top == "torch":
                if not torch_allowed:
                    bad.append(f"{path}:{line} imports {what}, but part {part} may not use torch")
            elif top in packages and not any(c in modules for c in candidates):
                bad.append(f"{path}:{line} imports {what}, which is in none of the parts "
                           f"{part} may use ({', '.join(allowed_parts)})")
    return bad


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", required=True)
    parser.add_argument("--root", required=True, help="the import root's workspace path (python)")
    parser.add_argument("--torch", action="store_true", help="the part may import torch")
    parser.add_argument("--stamp", required=True, help="written when the check passes")
    parser.add_argument("--check", action="append", default=[], help="a source of the part")
    parser.add_argument("--module", action="append", default=[], help="PART=FILE")
    args = parser.parse_args(argv)
    modules = {}
    for entry in args.module:
        part, path = entry.split("=", 1)
        name = module_name(path, args.root)
        if name is not None:
            modules[name] = part
    sources = {}
    for path in args.check:
        with open(path, encoding="utf-8") as f:
            sources[path] = f.read()
    bad = violations(args.part, args.torch, modules, sources, args.root)
    if bad:
        print(f"part {args.part}: imports its deps do not allow (tools/layers.bzl; the arrows are the deps "
              f"in its BUILD file):\n  " + "\n  ".join(bad), file=sys.stderr)
        return 1
    with open(args.stamp, "w", encoding="utf-8") as f:
        f.write(f"{args.part}: {len(sources)} files, imports within its deps\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
