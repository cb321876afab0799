#!/usr/bin/env bash
# The configure rules follow the machine (issue 19), in a scratch copy of the
# workspace with its own Bazel output base:
#   1. hipcc hidden (a PATH of links to every other program): --config=rocm
#      fails at analysis with its advice;
#   2. hipcc then appears on that same PATH, as `apt-get install hipcc` puts
#      it: the same command finds it, no `bazel clean --expunge`;
#   3. another PYTHON_BIN_PATH re-runs the Python and torch rule;
#   4. `bazel sync --configure` re-runs the configure rules.
# Run by .ci/run (which installs hipcc); needs hipcc on PATH and none in
# ROCM_PATH (/opt/rocm), and the project venv (or PYTHON_BIN_PATH).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
python_bin="${PYTHON_BIN_PATH:-${root}/.venv/bin/python3}"
hipcc="$(command -v hipcc || true)"
fail() { echo "configure_follows_toolchains: FAIL: $*" >&2; exit 1; }
[[ -n "${hipcc}" ]] || fail "needs hipcc on PATH (apt-get install hipcc libamdhip64-dev)"
[[ ! -e "${ROCM_PATH:-/opt/rocm}/bin/hipcc" ]] || fail "hipcc in ROCM_PATH cannot be hidden by PATH"

scratch="$(mktemp -d /tmp/pagoda-configure-XXXXXX)"
bin="${scratch}/bin"
cleanup() {
  (cd "${scratch}/ws" && PATH="${bin}" PYTHON_BIN_PATH="${python_bin}" tools/bazel clean --expunge >/dev/null 2>&1) || true
  rm -rf "${scratch}"
}
trap cleanup EXIT
mkdir "${scratch}/ws" "${scratch}/bin" "${scratch}/py"
(cd "${root}" && git ls-files -z | xargs -0 cp --parents -t "${scratch}/ws")
IFS=: read -r -a dirs <<<"${PATH}"
for dir in "${dirs[@]}"; do
  for program in "${dir}"/*; do
    name="${program##*/}"
    [[ -x "${program}" && ! -d "${program}" && "${name}" != hipcc* && ! -e "${bin}/${name}" ]] || continue
    ln -s "${program}" "${bin}/${name}"
  done
done

bazel() {  # bazel LOG ARGS...: tools/bazel in the scratch workspace on the hidden PATH
  local log=$1; shift
  (cd "${scratch}/ws" && PATH="${bin}" PYTHON_BIN_PATH="${python_bin}" tools/bazel "$@") >"${scratch}/${log}" 2>&1
}
output_base() {
  (cd "${scratch}/ws" && PATH="${bin}" PYTHON_BIN_PATH="${python_bin}" tools/bazel info output_base 2>/dev/null)
}

echo "1. hipcc hidden"
if bazel 1.log build --config=rocm --nobuild //cuda:hip_kernels; then
  fail "--config=rocm analysed without hipcc"
fi
grep -q "needs hipcc" "${scratch}/1.log" || { cat "${scratch}/1.log"; fail "no hipcc advice in the error"; }

echo "2. hipcc installed on the same PATH"
printf '#!/bin/sh\nexec %q "$@"\n' "${hipcc}" >"${bin}/hipcc"  # $0 stays the real hipcc (it finds its clang from there)
chmod +x "${bin}/hipcc"
bazel 2.log build --config=rocm --nobuild //cuda:hip_kernels || { cat "${scratch}/2.log"; fail "hipcc not found after it appeared"; }

echo "3. another PYTHON_BIN_PATH"
base="$(output_base)"
python_info="${base}/external/local_config_python/build_info.bzl"
before="$(stat -c %Y "${python_info}")"
printf '#!/bin/sh\nexec %q "$@"\n' "${python_bin}" >"${scratch}/py/python3"  # the same venv, another path
chmod +x "${scratch}/py/python3"
sleep 1.1
python_bin="${scratch}/py/python3" bazel 3.log build --nobuild //python/pagoda:_C.so \
  || { cat "${scratch}/3.log"; fail "build with another PYTHON_BIN_PATH"; }
[[ "$(stat -c %Y "${python_info}")" != "${before}" ]] || fail "the Python rule did not re-run for the new PYTHON_BIN_PATH"

echo "4. bazel sync --configure"
before="$(stat -c %Y "${base}/external/local_config_rocm/defs.bzl")"
sleep 1.1
bazel 4.log sync --configure || { cat "${scratch}/4.log"; fail "bazel sync --configure"; }
after="$(stat -c %Y "${base}/external/local_config_rocm/defs.bzl")"
[[ "${after}" != "${before}" ]] || fail "bazel sync --configure did not re-run rocm_configure"
echo "configure_follows_toolchains: ok"
