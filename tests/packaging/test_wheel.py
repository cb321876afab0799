"""The wheel from `tools/bazel build //:wheel`: its tags checked by real tools
(wheel, auditwheel, packaging's view of this interpreter), its metadata, and
its contents -- the pagoda sources and kernels, nothing else."""

from __future__ import annotations

import glob
import io
import os
import re
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
import torch
from elftools.elf.dynamic import DynamicSection
from elftools.elf.elffile import ELFFile
from packaging.requirements import Requirement
from packaging.tags import sys_tags
from packaging.utils import parse_wheel_filename

WHEEL_DIR = Path(os.environ["PAGODA_WHEEL_DIR"])
CHECKOUT = Path(os.environ["TEST_SRCDIR"]) / os.environ["TEST_WORKSPACE"]


@pytest.fixture(scope="module")
def wheel() -> Path:
    wheels = sorted(WHEEL_DIR.glob("*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def _tool(*args: str) -> str:
    result = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, check=True)
    return result.stdout


def _dist_info(wheel: Path, name: str) -> str:
    with zipfile.ZipFile(wheel) as archive:
        (path,) = [p for p in archive.namelist() if p.endswith(".dist-info/" + name)]
        return archive.read(path).decode()


def test_tags_are_this_interpreters(wheel):
    _, _, _, tags = parse_wheel_filename(wheel.name)
    # `wheel info` reads the WHEEL file: its tags must be the file name's.
    listed = re.search(r"Tags:\n((?:  \S+\n)+)", _tool("wheel", "info", str(wheel))).group(1).split()
    assert {str(t) for t in tags} == set(listed)
    (tag,) = tags
    python = "cp%d%d" % sys.version_info[:2]
    assert (tag.interpreter, tag.abi) == (python, python + sys.abiflags)
    # The most specific tag this interpreter installs: what pip checks.
    assert tag in set(sys_tags())


def test_platform_tag_is_what_auditwheel_finds(wheel):
    _, _, _, tags = parse_wheel_filename(wheel.name)
    report = " ".join(_tool("auditwheel", "show", str(wheel)).split())
    found = re.search(r'consistent with the following platform tag: "([^"]+)"', report).group(1)
    assert {t.platform for t in tags} == {found}


def test_record_hashes_verify(wheel, tmp_path):
    # `wheel unpack` checks every file against RECORD's sha256 and size.
    _tool("wheel", "unpack", "-d", str(tmp_path), str(wheel))


def test_requirements_pin_the_torch_of_the_kernels(wheel):
    metadata = Parser().parsestr(_dist_info(wheel, "METADATA"))
    requires = {Requirement(line).name: str(Requirement(line).specifier) for line in metadata.get_all("Requires-Dist")}
    assert requires["torch"] == "==" + torch.__version__.split("+")[0]
    runtime, build_and_test = (CHECKOUT / "requirements.txt").read_text().split("# [build-and-test]")
    pins = {Requirement(line).name: str(Requirement(line).specifier)
            for line in runtime.split("# [runtime]")[1].splitlines() if line and not line.startswith("#")}
    assert requires == dict(pins, torch=requires["torch"])
    assert "pytest" in build_and_test and "pytest" not in requires
    assert metadata["Version"] == parse_wheel_filename(wheel.name)[1].public


def _runpaths(library) -> list[str]:
    entries = []
    for section in ELFFile(library).iter_sections():
        if isinstance(section, DynamicSection):
            for tag in section.iter_tags():
                if tag.entry.d_tag in ("DT_RUNPATH", "DT_RPATH"):
                    entries += getattr(tag, "runpath", getattr(tag, "rpath", "")).split(":")
    return entries


def test_libraries_find_torch_relative_to_themselves(wheel):
    # No path of the build machine (the configured venv's torch/lib) in a
    # shipped library: only $ORIGIN-relative entries (pyelftools, auditwheel's ELF reader).
    with zipfile.ZipFile(wheel) as archive:
        libraries = [n for n in archive.namelist() if n.endswith(".so")]
        assert libraries
        for name in libraries:
            with archive.open(name) as member:
                assert _runpaths(io.BytesIO(member.read())) == ["$ORIGIN/../torch/lib"], name


def test_console_script_is_the_cli(wheel):
    assert "pagoda = pagoda.entrypoints.cli:main" in _dist_info(wheel, "entry_points.txt").splitlines()


def test_contents_are_the_package_and_its_kernels(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    source = CHECKOUT / "python"
    patterns = ["pagoda/**/*.py", "pagoda/*.so", "pagoda/benchmarks/model_shapes/*/config.json"]
    expected = {str(Path(p).relative_to(source)) for pattern in patterns
                for p in glob.glob(str(source / pattern), recursive=True)}
    assert "pagoda/_C.so" in expected
    packaged = {n for n in names if not n.startswith("pagoda-")}
    assert packaged == expected
    debris = [n for n in names if "__pycache__" in n or n.endswith(".pyc") or n.startswith("tests/")
              or re.fullmatch(r"test_.*\.py|.*_test\.py|conftest\.py|BUILD(\.bazel)?", Path(n).name)]
    assert not debris
    assert {n.split("/", 1)[1] for n in names - packaged} == {"METADATA", "WHEEL", "RECORD", "entry_points.txt"}
