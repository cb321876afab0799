#!/usr/bin/env bash
# Checks a Bazel-built CUDA wheel on the GPU host (issue 14, item 3), in one
# command: no Bazel, no network, the machine's own torch. Run from the
# repository root (only tests/ and the carried wheels are read from it):
#
#   tools/gpu/wheel_check.sh .gpucarry/wheel/pagoda-0.1.0-cp312-cp312-linux_x86_64.whl
#
# 1. a fresh venv seeing the host's packages (its torch, triton, transformers):
#    --system-site-packages, plus the site-packages of the host's python3 when
#    that is itself a venv (the H200 image's is); the wheel and the carried
#    wheels in .whl/ (starlette, uvicorn, pydantic, pyzmq, msgspec, httptools,
#    ...) installed with --no-deps --no-index;
# 2. outside the checkout: pagoda, its kernels and the `pagoda` command come
#    from that venv (checked), the wheel's torch pin is the running torch, the
#    CUDA ops are registered;
# 3. `pagoda bench throughput --model-shape Qwen3-0.6B` (nano-vllm's 256
#    requests, dummy weights);
# 4. tests/ops -k "cuda or triton or sampling" and tests/gpu, copied to a
#    temporary folder and run against the installed package.
#
# Each step is bounded (bench 150 s, tests 200 s + 220 s, as in
# tools/gpu/h200_suite.sh): under the 10 minutes of one device call. Logs and
# the benchmark's JSON go to $OUT (default ./wheel-check-results); the last
# lines printed are a summary. PYTHON (default python3) is the host
# interpreter; PAGODA_WHEELS (default .whl) the folder of carried wheels.
set -uo pipefail

wheel=${1:?usage: tools/gpu/wheel_check.sh WHEEL}
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
host_python=${PYTHON:-python3}
carried=${PAGODA_WHEELS:-$root/.whl}
out=${OUT:-wheel-check-results}
mkdir -p "$out" && out=$(cd "$out" && pwd)
wheel=$(cd "$(dirname "$wheel")" && pwd)/$(basename "$wheel")
[[ -f $wheel ]] || { echo "wheel_check: no wheel at $wheel" >&2; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
venv=$work/venv
unset PYTHONPATH
export PYTHONUNBUFFERED=1
summary=()

step() {  # step NAME SECONDS COMMAND...: run (bounded; 0: unbounded, e.g. a shell function), log to $out/NAME.log, remember the verdict
  local name=$1 limit=$2; shift 2
  local started=$SECONDS rc
  if (( limit > 0 )); then timeout "$limit" "$@"; else "$@"; fi >"$out/$name.log" 2>&1
  rc=$?
  summary+=("$(printf '%-12s rc=%-3s %4ss  %s' "$name" "$rc" $((SECONDS - started)) "$(tail -n 1 "$out/$name.log")")")
  return $rc
}

finish() {
  cat "$out/host.txt"
  printf '%s\n' "${summary[@]}"
  exit "$1"
}

{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  "$host_python" -c 'import sys, torch, triton, transformers
print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)'
  echo "wheel $(basename "$wheel") $(du -k "$wheel" | cut -f1) KiB"
} >"$out/host.txt" 2>&1

install_wheel() {
  local pip=("$venv/bin/python" -m pip --disable-pip-version-check)
  if ! "$host_python" -m venv --system-site-packages "$venv"; then
    # No ensurepip for the base interpreter: the host's pip installs into the venv.
    rm -rf "$venv"
    "$host_python" -m venv --system-site-packages --without-pip "$venv" || return 1
    pip=("$host_python" -m pip --disable-pip-version-check --python "$venv/bin/python")
  fi
  local site
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') || return 1
  # A venv's --system-site-packages reaches its base interpreter, not the
  # host venv that holds torch: add that venv's site-packages after ours.
  "$host_python" -c 'import site, sys
if sys.prefix != sys.base_prefix:
    print("import site; " + "; ".join("site.addsitedir(%r)" % d for d in site.getsitepackages()))' \
    >"$site/_pagoda_host_site_packages.pth" || return 1
  cat "$site/_pagoda_host_site_packages.pth"
  local extra=()
  shopt -s nullglob
  extra=("$carried"/*.whl)
  shopt -u nullglob
  "${pip[@]}" install --no-deps --no-index "$wheel" "${extra[@]}" || return 1
  echo "pip check (informational: the host's pins differ from requirements.txt's):"
  "${pip[@]}" check || true
  echo "installed $(basename "$wheel")"
}
step install 0 install_wheel || finish 1

# Everything below runs from a folder outside the checkout, with the venv's
# python3 and pagoda first on PATH.
mkdir -p "$work/tests" && cd "$work" || finish 1
export PATH=$venv/bin:$PATH

cat >"$work/installed.py" <<'EOF'
import importlib.metadata
import os
import shutil
import sys

import torch

import pagoda
from pagoda import _native

venv = os.path.realpath(sys.prefix) + os.sep
checkout = os.path.realpath(os.environ["PAGODA_CHECKOUT"]) + os.sep
problems = []
print("pagoda", pagoda.__file__)
print("torch ", torch.__version__, torch.__file__)
print("pagoda command", shutil.which("pagoda"))
if not os.path.realpath(pagoda.__file__).startswith(venv):
    problems.append(f"pagoda imported from {pagoda.__file__}, not from the venv {venv}")
inside = [p for p in sys.path if os.path.realpath(p or ".").startswith(checkout)]
if inside:
    problems.append(f"the checkout is on sys.path: {inside}")
if not os.path.realpath(shutil.which("pagoda") or "").startswith(venv):
    problems.append("the pagoda command is not the venv's")
pin = [r for r in importlib.metadata.requires("pagoda") if r.replace(" ", "").startswith("torch==")]
print("pin", pin)
if pin != ["torch==" + torch.__version__.split("+")[0]]:
    problems.append(f"the wheel pins {pin}, the host runs torch {torch.__version__}")
for name in ("_C", "_cuda_ops"):
    path = _native.find_library(name)
    print(name, path, path and _native.read_build_info(path))
    if path is None or not os.path.realpath(path).startswith(venv):
        problems.append(f"{name}.so is not in the installed package")
if not torch.cuda.is_available():
    problems.append("torch sees no CUDA GPU")
elif not _native.has_cuda_ops():
    problems.append("torch.ops.pagoda.* have no CUDA kernels after loading the wheel's _cuda_ops.so")
else:
    print("device", torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability())
print("; ".join(problems) if problems else "installed package OK: pagoda, kernels and command from the venv")
sys.exit(1 if problems else 0)
EOF
step installed 60 env PAGODA_CHECKOUT="$root" "$venv/bin/python" "$work/installed.py" || finish 1

step bench 150 "$venv/bin/pagoda" bench throughput --model-shape Qwen3-0.6B --dataset-name nano-vllm \
  --max-model-len 4096 --disable-tqdm --output-json "$out/qwen3_nano.json"

# The tests, away from the checkout; this conftest fails the run if pytest
# would test anything but the installed package.
cp -r "$root/tests/ops" "$root/tests/gpu" "$root/tests/models" "$work/tests/"
find "$work/tests" -name __pycache__ -prune -exec rm -r {} +
cat >"$work/tests/conftest.py" <<'EOF'
import os
import sys

import pagoda

_VENV = os.path.realpath(sys.prefix) + os.sep
if not os.path.realpath(pagoda.__file__).startswith(_VENV):
    raise RuntimeError(f"pagoda comes from {pagoda.__file__}, not from the wheel installed in {_VENV}")


def pytest_report_header(config):
    return f"pagoda under test: {pagoda.__file__}"
EOF
pytest=("$venv/bin/python" -m pytest -p no:cacheprovider)
step ops_cuda 200 "${pytest[@]}" -k "cuda or triton or sampling" tests/ops
step gpu_tests 220 "${pytest[@]}" tests/gpu

rc=0
for line in "${summary[@]}"; do [[ $line == *"rc=0 "* ]] || rc=1; done
finish "$rc"
