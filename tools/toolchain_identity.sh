#!/usr/bin/env bash
# The identity of the toolchains the configure rules look for: what each
# would find (the C++ compiler, nvcc at CUDA_PATH, hipcc at ROCM_PATH or on
# PATH, the Python interpreter, its torch) as path, size and modification
# time of the file itself, so installing, upgrading or removing one changes
# it without running any compiler. tools/bazel passes its digest to Bazel as
# --repo_env=PAGODA_TOOLCHAIN_ID, which every configure rule lists in its
# `environ`: a changed toolchain re-runs them, no `bazel clean --expunge`.
#
#   tools/toolchain_identity.sh PYTHON            one line per toolchain
#   tools/toolchain_identity.sh --digest PYTHON   their sha256
set -euo pipefail

digest=0
if [[ "${1:-}" == --digest ]]; then digest=1; shift; fi
python_bin="${1:?usage: toolchain_identity.sh [--digest] PYTHON}"

describe() {  # describe NAME PATH-OR-EMPTY
  local name=$1 path=${2:-}
  if [[ -n "${path}" && -e "${path}" ]]; then
    local resolved
    resolved="$(readlink -f "${path}")"
    echo "${name} ${path} ${resolved} $(stat -L -c '%s %Y' "${resolved}")"
  else
    echo "${name} none"
  fi
}

first_file() {  # the first argument that is an existing file, else the empty string
  local candidate
  for candidate in "$@"; do
    if [[ -n "${candidate}" && -f "${candidate}" ]]; then echo "${candidate}"; return; fi
  done
}

identity() {
  describe cc "$(command -v "${CC:-cc}" || true)"
  describe c++ "$(command -v "${CXX:-c++}" || true)"
  # The same places cuda_configure.bzl and rocm_configure.bzl look.
  describe nvcc "$(first_file "${CUDA_PATH:-/usr/local/cuda}/bin/nvcc")"
  describe hipcc "$(first_file "${ROCM_PATH:-/opt/rocm}/bin/hipcc" "$(command -v hipcc || true)")"
  describe python "${python_bin}"
  # torch's version file, found without importing torch (milliseconds).
  local torch_version
  torch_version="$("${python_bin}" -c 'import importlib.util, os
spec = importlib.util.find_spec("torch")
print(os.path.join(os.path.dirname(spec.origin), "version.py") if spec and spec.origin else "")' 2>/dev/null || true)"
  describe torch "${torch_version}"
}

if (( digest )); then
  identity | sha256sum | cut -c1-16
else
  identity
fi
