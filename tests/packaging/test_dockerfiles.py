"""docker/*.Dockerfile: hadolint (pinned in requirements.txt) finds nothing,
and each image installs the Bazel-built wheel through docker/pagoda-image.sh
(the sequence tests/packaging/image_sequence.sh runs in CI), as a non-root
user, exposing the server's port with a HEALTHCHECK on /health."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

DOCKER = Path(os.environ["TEST_SRCDIR"]) / os.environ["TEST_WORKSPACE"] / "docker"
DOCKERFILES = ["cpu.Dockerfile", "cuda.Dockerfile", "rocm.Dockerfile"]


def _instructions(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (DOCKER / name).read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [tuple(line.split(None, 1)) for line in lines]


def _all(name: str, instruction: str) -> list[str]:
    return [args for op, args in _instructions(name) if op == instruction]


@pytest.mark.parametrize("name", DOCKERFILES)
def test_hadolint_finds_nothing(name):
    hadolint = os.path.join(os.path.dirname(sys.executable), "hadolint")
    result = subprocess.run([hadolint, "--no-color", "--config", str(DOCKER / ".hadolint.yaml"), str(DOCKER / name)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("name", DOCKERFILES)
def test_installs_the_wheel_through_the_image_script(name):
    copies = " ".join(_all(name, "COPY"))
    assert "dist/${WHEEL}" in copies and "docker/pagoda-image.sh" in copies
    # No source in the image: only the wheel, the script and the model pin.
    assert not re.search(r"\b(python/|cc/|cuda/|bazel|build_ext)", copies + " ".join(_all(name, "RUN")))
    assert any("/opt/pagoda/pagoda-image.sh install /tmp/${WHEEL}" in run for run in _all(name, "RUN"))
    assert _all(name, "ENTRYPOINT") == ['["/opt/pagoda/pagoda-image.sh", "serve"]']


@pytest.mark.parametrize("name", DOCKERFILES)
def test_runs_as_a_non_root_user_with_port_and_healthcheck(name):
    users = _all(name, "USER")
    assert users and users[-1].isdigit() and int(users[-1]) != 0
    assert _all(name, "EXPOSE") == ["8000"]
    (healthcheck,) = _all(name, "HEALTHCHECK")
    assert "http://127.0.0.1:8000/health" in healthcheck


def test_cpu_image_python_is_the_wheels():
    # The CPU wheel is built for the configured interpreter (this one).
    (base,) = _all("cpu.Dockerfile", "FROM")
    assert re.fullmatch(r"python:%d\.%d\.\d+-slim-\w+" % sys.version_info[:2], base), base
