"""Packs files into a PEP 427 wheel (run by the py_wheel rule, tools/wheel.bzl).

The version is read from the package's version.py (`__version__`, stated once
there); Requires-Dist comes from the runtime section of requirements.txt, with
torch pinned to the version the kernels were compiled against. The python, ABI
and platform tags are those of the interpreter running this script, which the
rule checks is the configured one (the extensions were built for it).

  build_wheel.py --name pagoda --out-dir DIR --requirements requirements.txt
      --torch-version 2.13.0+cpu --python-version 3.11 --entry-point pagoda=pagoda.entrypoints.cli:main
      --summary TEXT ARCHIVE_PATH=FILE ...
"""

from __future__ import annotations

import argparse
import ast
import base64
import hashlib
import os
import re
import sys
import sysconfig
import zipfile

# Fixed times and modes: the same inputs give the same bytes.
_ZIP_TIME = (1980, 1, 1, 0, 0, 0)
_RUNTIME_HEADING = "# [runtime]"
_BUILD_HEADING = "# [build-and-test]"


def runtime_requirements(requirements_text: str, torch_version: str) -> list[str]:
    """The lines between the [runtime] and [build-and-test] headings, torch's
    pin replaced by the torch the extensions were built against (its local
    label dropped: pagoda._native compares public versions too)."""
    lines = requirements_text.splitlines()
    if _RUNTIME_HEADING not in lines or _BUILD_HEADING not in lines:
        raise SystemExit(f"requirements.txt needs the headings {_RUNTIME_HEADING!r} and {_BUILD_HEADING!r}")
    section = lines[lines.index(_RUNTIME_HEADING) + 1:lines.index(_BUILD_HEADING)]
    requirements = []
    for line in section:
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name = re.split(r"[=<>!~\[; ]", line, maxsplit=1)[0]
        requirements.append(f"torch=={torch_version.split('+')[0]}" if name == "torch" else line)
    if not any(r.startswith("torch==") for r in requirements):
        raise SystemExit("requirements.txt's [runtime] section must list torch")
    return requirements


def package_version(init_source: str) -> str:
    """`__version__ = "..."` of a module, read without importing it."""
    for node in ast.parse(init_source).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__version__" for t in node.targets):
            return ast.literal_eval(node.value)
    raise SystemExit("no __version__ in the package's version.py")


def interpreter_tag(python_version: str) -> str:
    """cpXY-cpXY<abiflags>-<platform> of this interpreter, which must be the
    one the extensions were compiled for."""
    running = "%d.%d" % sys.version_info[:2]
    if running != python_version or sys.implementation.name != "cpython":
        raise SystemExit(f"build_wheel.py runs under {sys.implementation.name} {running}, "
                         f"but the extensions were built for CPython {python_version}")
    python = "cp%d%d" % sys.version_info[:2]
    platform = sysconfig.get_platform().replace("-", "_").replace(".", "_")
    return f"{python}-{python}{sys.abiflags}-{platform}"


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"sha256={digest}"


def _add(archive: zipfile.ZipFile, path: str, data: bytes, executable: bool = False) -> None:
    info = zipfile.ZipInfo(path, _ZIP_TIME)
    info.compress_type = zipfile.ZIP_DEFLATED
    info.external_attr = (0o100755 if executable else 0o100644) << 16
    archive.writestr(info, data)


def build(args: argparse.Namespace) -> str:
    files = dict(item.split("=", 1) for item in args.files)
    version_file = f"{args.name}/version.py"
    if version_file not in files:
        raise SystemExit(f"{version_file} is not among the wheel's files")
    with open(files[version_file], encoding="utf-8") as f:
        version = package_version(f.read())
    with open(args.requirements, encoding="utf-8") as f:
        requires = runtime_requirements(f.read(), args.torch_version)
    tag = interpreter_tag(args.python_version)
    dist_info = f"{args.name}-{version}.dist-info"

    metadata = ["Metadata-Version: 2.1", f"Name: {args.name}", f"Version: {version}",
                f"Summary: {args.summary}", f"Requires-Python: =={args.python_version}.*"]
    metadata += [f"Requires-Dist: {r}" for r in requires]
    wheel = ["Wheel-Version: 1.0", "Generator: pagoda tools/build_wheel.py", "Root-Is-Purelib: false", f"Tag: {tag}"]
    entry_points = ["[console_scripts]"] + [e.replace("=", " = ", 1) for e in args.entry_point]
    generated = {
        f"{dist_info}/METADATA": "\n".join(metadata) + "\n",
        f"{dist_info}/WHEEL": "\n".join(wheel) + "\n",
        f"{dist_info}/entry_points.txt": "\n".join(entry_points) + "\n",
    }

    out = os.path.join(args.out_dir, f"{args.name}-{version}-{tag}.whl")
    os.makedirs(args.out_dir, exist_ok=True)
    record = []
    with zipfile.ZipFile(out, "w") as archive:
        for path in sorted(files):
            with open(files[path], "rb") as f:
                data = f.read()
            _add(archive, path, data, executable=path.endswith(".so"))
            record.append(f"{path},{_record_hash(data)},{len(data)}")
        for path, text in generated.items():
            data = text.encode()
            _add(archive, path, data)
            record.append(f"{path},{_record_hash(data)},{len(data)}")
        record.append(f"{dist_info}/RECORD,,")
        _add(archive, f"{dist_info}/RECORD", ("\n".join(record) + "\n").encode())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--name", required=True)
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--requirements", required=True)
    parser.add_argument("--torch-version", required=True)
    parser.add_argument("--python-version", required=True)
    parser.add_argument("--summary", required=True)
    parser.add_argument("--entry-point", action="append", default=[])
    parser.add_argument("files", nargs="+", metavar="ARCHIVE_PATH=FILE")
    build(parser.parse_args())


if __name__ == "__main__":
    main()
