#!/usr/bin/env bash
# The serving path against the engine on the GPU host, in one command: the
# same requests through `pagoda serve` (client: `pagoda bench serve`) and
# through `pagoda bench throughput`, plus a py-spy profile of the server
# under saturation (where the host time goes, per thread).
#
#   tools/gpu/serve_vs_offline.sh SHAPE TOKENIZER_DIR [RATE ...]
#
# SHAPE: a model shape of python/pagoda/benchmarks/model_shapes (dummy
# weights); TOKENIZER_DIR: a Hugging Face tokenizer folder (the real one of
# that model: see docs/BENCHMARKS.md for where it comes from). RATEs default
# to "inf"; NUM_PROMPTS (1000), INPUT_LEN (512) and OUTPUT_LEN (128) set the workload
# (RATED_PROMPTS, default NUM_PROMPTS: the prompts of each finite rate's run);
# SERVER_ARGS go to the server (e.g. --api-server-count 2), TAG names such a
# run's files; SKIP_OFFLINE=1 leaves out the offline run. Needs the server's packages (starlette, uvicorn, pydantic) and,
# for the profile, py-spy on PATH. Logs and JSON go to $OUT (default
# ./gpu-results).
set -uo pipefail
shape=$1 tokenizer=$2; shift 2
rates=("${@:-inf}")
out=${OUT:-gpu-results}
mkdir -p "$out"
export PYTHONPATH=python${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
model=python/pagoda/benchmarks/model_shapes/$shape
name=$shape${TAG:+_$TAG}
workload=(--dataset-name random --num-prompts "${NUM_PROMPTS:-1000}" --input-len "${INPUT_LEN:-512}"
  --output-len "${OUTPUT_LEN:-128}" --seed 0)
port=8123

python3 -m pagoda.entrypoints.openai.api_server --model "$model" --load-format dummy --tokenizer "$tokenizer" \
  --served-model-name "$shape" --port $port --disable-log-requests ${SERVER_ARGS:-} >"$out/server_$name.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null' EXIT
for _ in $(seq 600); do
  python3 -c "import httpx, sys; sys.exit(httpx.get('http://127.0.0.1:$port/health').status_code != 200)" \
    2>/dev/null && break
  kill -0 $server 2>/dev/null || { tail -20 "$out/server_$name.log"; exit 1; }
  sleep 0.5
done

for rate in "${rates[@]}"; do
  profile=()
  if [[ $rate == inf ]] && command -v py-spy >/dev/null; then
    # 20 s in the middle of the saturated run; --idle off: only time spent running.
    # --subprocesses: the engine-core process too.
    (sleep 8 && py-spy record --pid $server --subprocesses --duration 20 --rate 200 --threads --format raw \
      --output "$out/profile_$name.txt" >"$out/py-spy_$name.log" 2>&1) &
    profile=($!)
  fi
  # Random prompts are token ids of the model's vocabulary (its config); the server detokenizes.
  prompts=()
  [[ $rate != inf ]] && prompts=(--num-prompts "${RATED_PROMPTS:-${NUM_PROMPTS:-1000}}")
  python3 -m pagoda.entrypoints.cli bench serve --port $port --model "$shape" --tokenizer "$model" \
    "${workload[@]}" "${prompts[@]}" --ignore-eos --request-rate "$rate" --disable-tqdm --save-result --result-dir "$out" \
    --result-filename "serve_${name}_rate_$rate.json" 2>&1 | tail -n 22
  [[ ${#profile[@]} -gt 0 ]] && wait "${profile[0]}"
done
kill $server; wait $server 2>/dev/null; trap - EXIT

[[ ${SKIP_OFFLINE:-0} == 1 ]] || python3 -m pagoda.entrypoints.cli bench throughput --model-shape "$shape" --tokenizer "$tokenizer" "${workload[@]}" \
  --disable-tqdm --output-json "$out/throughput_$shape.json" 2>&1 | tail -n 2

if [[ -f $out/profile_$name.txt ]]; then
  python3 tools/gpu/profile_summary.py "$out/profile_$name.txt"
fi
