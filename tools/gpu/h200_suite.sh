#!/usr/bin/env bash
# The GPU host's checks and benchmarks in one command (a lent machine stays
# warm only seconds between commands). Run from the repository root on a host
# with torch + CUDA and no Bazel:
#
#   tools/gpu/h200_suite.sh check      build, CUDA op tests, GPU engine tests
#   tools/gpu/h200_suite.sh bench      kernel and engine benchmarks
#   tools/gpu/h200_suite.sh all        both
#
# Logs and JSON go to $OUT (default ./gpu-results); the last lines printed are
# a summary.
set -uo pipefail
stage=${1:-all}
out=${OUT:-gpu-results}
mkdir -p "$out"
export PYTHONPATH=python:tests/models${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
summary=()

step() {  # step NAME SECONDS COMMAND...: run (bounded), log to $out/NAME.log, remember the verdict
  local name=$1 limit=$2; shift 2
  local started=$SECONDS
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  summary+=("$(printf '%-28s rc=%-3s %4ss  %s' "$name" "$rc" $((SECONDS - started)) "$(tail -n 1 "$out/$name.log")")")
  return $rc
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >"$out/gpu.txt" 2>&1
python3 -c 'import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)' >>"$out/gpu.txt" 2>&1

step build 300 python3 tools/build_ext.py --cuda-archs sm_90a || { cat "$out/build.log"; exit 1; }

if [[ $stage == check || $stage == all ]]; then
  step ops_cuda 200 python3 -m pytest -q -k "cuda or triton or sampling" tests/ops
  step gpu_engine 220 python3 -m pytest -q tests/gpu
fi

if [[ $stage == bench || $stage == all ]]; then
  step bench_paged_attention 120 python3 tools/benchmarks/bench_paged_attention.py --no-flex --output-json "$out/paged_attention.json"
fi

cat "$out/gpu.txt"
printf '%s\n' "${summary[@]}"
