#!/usr/bin/env bash
# The remote cache (issue 14), end to end: a cache server of its own
# (tools/cache_server.sh on a free port) and two scratch copies of the
# workspace, each with its own Bazel output base and no disk cache:
#   1. copy A builds the CPU extension with --config=remote-cache: every
#      process runs locally and is uploaded;
#   2. copy B -- another path, a fresh output base and another PATH, as a
#      second machine with the same toolchains -- builds the same: every
#      process is a remote cache hit (Bazel's "N processes: ..." line) and
#      the outputs are byte-identical to A's;
#   3. A, its output base wiped, with another nvcc version (a CUDA_PATH
#      whose nvcc says so) builds CPU kernels: no remote hit, as the
#      toolchain versions are in every action's key.
# Run by .ci/run; uses the project venv (or PYTHON_BIN_PATH).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
python_bin="${PYTHON_BIN_PATH:-${root}/.venv/bin/python3}"
fail() { echo "remote_cache: FAIL: $*" >&2; exit 1; }
# On a fresh clone tools/bazel makes the project venv, which both copies share.
[[ -x "${python_bin}" ]] || "${root}/tools/bazel" --version >/dev/null || fail "no venv at ${python_bin}"

scratch="$(mktemp -d /tmp/pagoda-remote-cache-XXXXXX)"
export PAGODA_CACHE_DIR="${scratch}/cache"
PAGODA_CACHE_PORT="$("${python_bin}" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
export PAGODA_CACHE_PORT
cache_url="http://127.0.0.1:${PAGODA_CACHE_PORT}"

bazel() {  # bazel COPY LOG ARGS...: tools/bazel in a scratch copy, on its own output base
  local copy=$1 log=$2; shift 2
  (cd "${scratch}/${copy}" && PYTHON_BIN_PATH="${python_bin}" \
    tools/bazel --output_base="${scratch}/base-${copy}" --max_idle_secs=600 "$@") >"${scratch}/${log}" 2>&1
}
cleanup() {
  local copy
  for copy in a b; do
    [[ ! -d "${scratch}/base-${copy}" ]] || bazel "${copy}" shutdown.log shutdown || true
  done
  "${root}/tools/cache_server.sh" stop >/dev/null || true
  rm -rf "${scratch}"
}
trap cleanup EXIT

for copy in a b; do
  mkdir "${scratch}/${copy}"
  (cd "${root}" && git ls-files -z | xargs -0 cp --parents -t "${scratch}/${copy}")
done
"${root}/tools/cache_server.sh" start

targets=(//python/pagoda:_C.so //cc:cpu_dispatch //cc:torch_ops)
build() {  # build COPY LOG ARGS...: the targets against the scratch cache server
  local copy=$1 log=$2; shift 2
  bazel "${copy}" "${log}" build --config=remote-cache --remote_cache="${cache_url}" --disk_cache= "$@" \
    || { cat "${scratch}/${log}"; fail "build in copy ${copy}"; }
}
summary() {  # Bazel's last "N processes: ..." line in LOG (none when nothing ran)
  grep -E '^INFO: [0-9]+ processes' "${scratch}/$1" | tail -n 1 || true
}
processes() {  # processes LOG KIND: the count of KIND in the summary
  local line
  line="$(summary "$1")"
  echo "  $1: ${line#INFO: }" >&2
  sed -E 's/^INFO: [0-9]+ processes: //; s/\.$//' <<<"${line}" | tr ',' '\n' \
    | awk -v kind="$2" '{ count = $1; $1 = ""; sub(/^ /, ""); if ($0 == kind) total += count } END { print total + 0 }'
}
run_locally() {  # run_locally LOG: processes that were neither internal nor remote hits
  local all internal hits
  all="$(summary "$1" | awk '{ n = $2 } END { print n + 0 }')"
  internal="$(processes "$1" internal 2>/dev/null)"
  hits="$(processes "$1" "remote cache hit" 2>/dev/null)"
  echo $(( all - internal - hits ))
}
outputs() {  # sha256 of every built library and object of COPY
  (cd "${scratch}/$1/bazel-bin" && find . -type f \( -name '*.so' -o -name '*.a' -o -name '*.o' \) -print0 \
    | sort -z | xargs -0 sha256sum)
}

echo "1. copy A builds and uploads"
build a 1.log "${targets[@]}"
[[ "$(processes 1.log "remote cache hit")" == 0 ]] || fail "hits in an empty cache"
[[ "$(run_locally 1.log)" -gt 0 ]] || fail "copy A ran nothing"
outputs a >"${scratch}/a.sha256"
bazel a shutdown.log shutdown

echo "2. copy B (another path, fresh output base, another PATH) hits"
mkdir "${scratch}/extra-bin"
PATH="${scratch}/extra-bin:${PATH}" build b 2.log "${targets[@]}"
[[ "$(run_locally 2.log)" == 0 ]] || { cat "${scratch}/2.log"; fail "processes ran locally in copy B: not every action was a remote hit"; }
[[ "$(processes 2.log "remote cache hit")" -gt 0 ]] || fail "no remote hits in copy B"
outputs b >"${scratch}/b.sha256"
[[ -s "${scratch}/b.sha256" ]] || fail "no outputs"
diff "${scratch}/a.sha256" "${scratch}/b.sha256" || fail "outputs differ from copy A's"
echo "  $(wc -l <"${scratch}/b.sha256") outputs byte-identical"

echo "3. another nvcc version misses"
mkdir -p "${scratch}/cuda/bin" "${scratch}/cuda/include" "${scratch}/cuda/lib64"
printf '#!/bin/sh\necho "Cuda compilation tools, release 0.1, V0.1.0"\n' >"${scratch}/cuda/bin/nvcc"
chmod +x "${scratch}/cuda/bin/nvcc"
bazel a expunge.log clean --expunge
CUDA_PATH="${scratch}/cuda" build a 3.log //cc:cpu_kernels_avx2
[[ "$(processes 3.log "remote cache hit")" == 0 ]] || fail "a changed toolchain version still hit the cache"
[[ "$(run_locally 3.log)" -gt 0 ]] || fail "nothing was rebuilt for the changed toolchain"
echo "remote_cache: ok"
