#!/usr/bin/env bash
# The identity of the toolchains the configure rules look for: what each
# would find (the C++ compiler, nvcc at CUDA_PATH, hipcc at ROCM_PATH or on
# PATH, the Python interpreter, its torch) as path, size and modification
# time of the file itself, so installing, upgrading or removing one changes
# it without running any compiler. tools/bazel passes its digest to Bazel as
# --repo_env=PAGODA_TOOLCHAIN_ID, which every configure rule lists in its
# `environ`: a changed toolchain re-runs them, no `bazel clean --expunge`.
#
# The versions of the same toolchains (what each compiler says it is; Python's
# version and ABI; torch's version and build) go to every action as
# --action_env=PAGODA_TOOLCHAIN_VERSIONS, so they are part of each action's
# cache key: machines with other toolchains never share a cache entry, and
# machines with the same ones share entries wherever their checkouts lie.
# Running the compilers takes about 0.4 s, so their digest is kept under
# ~/.cache/pagoda, keyed by the file identity, and read again when it changes.
#
#   tools/toolchain_identity.sh PYTHON                    one line per toolchain file
#   tools/toolchain_identity.sh --digest PYTHON           their sha256
#   tools/toolchain_identity.sh --versions PYTHON         one line per toolchain version
#   tools/toolchain_identity.sh --versions-digest PYTHON  their sha256
set -euo pipefail

mode=files
case "${1:-}" in
  --digest|--versions|--versions-digest) mode="${1#--}"; shift ;;
esac
python_bin="${1:?usage: toolchain_identity.sh [--digest|--versions|--versions-digest] PYTHON}"

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
  # Bazel's C++ toolchain takes CC, else gcc from PATH.
  describe cc "$(command -v "${CC:-gcc}" || true)"
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

versions() {
  local cc nvcc hipcc
  cc="$(command -v "${CC:-gcc}" || true)"
  nvcc="$(first_file "${CUDA_PATH:-/usr/local/cuda}/bin/nvcc")"
  hipcc="$(first_file "${ROCM_PATH:-/opt/rocm}/bin/hipcc" "$(command -v hipcc || true)")"
  echo "cc ${cc:+$("${cc}" --version 2>/dev/null | head -n 1)}"
  echo "nvcc ${nvcc:+$("${nvcc}" --version 2>/dev/null | grep -E 'release|^Build' | tr '\n' ' ')}"
  # An explicit target spares hipcc probing for a GPU.
  echo "hipcc ${hipcc:+$(HIP_PLATFORM=amd "${hipcc}" --offload-arch=gfx90a --version 2>/dev/null | grep -i version | tr '\n' ' ')}"
  "${python_bin}" -c 'import importlib.util, os, re, sys, sysconfig
print("python", sys.version.split()[0], sysconfig.get_config_var("SOABI"))
spec = importlib.util.find_spec("torch")
path = os.path.join(os.path.dirname(spec.origin), "version.py") if spec and spec.origin else ""
text = open(path).read() if os.path.isfile(path) else ""
print("torch", *re.findall(r"^(?:__version__|git_version|cuda|hip)\b.*?= *(.*)$", text, re.M))' 2>/dev/null \
    || echo "python none"
}

versions_digest() {
  local memo
  memo="${XDG_CACHE_HOME:-${HOME}/.cache}/pagoda/toolchain-versions/$(identity | sha256sum | cut -c1-16)"
  if [[ ! -s "${memo}" ]]; then
    mkdir -p "$(dirname "${memo}")"
    versions | sha256sum | cut -c1-16 >"${memo}.$$"
    mv "${memo}.$$" "${memo}"
  fi
  cat "${memo}"
}

case "${mode}" in
  files) identity ;;
  digest) identity | sha256sum | cut -c1-16 ;;
  versions) versions ;;
  versions-digest) versions_digest ;;
esac
