#!/usr/bin/env bash
# The serving path against the engine on the GPU host, in one command: the
# same requests through `pagoda serve` (client: `pagoda bench serve`) and
# through `pagoda bench throughput`, plus, under saturation, the CPU each
# process uses (tools/gpu/proc_cpu.py) and py-spy profiles of the server and
# the client (where the host time goes, per thread).
#
#   tools/gpu/serve_vs_offline.sh SHAPE TOKENIZER_DIR [RATE ...]
#
# SHAPE: a model shape of python/pagoda/benchmarks/model_shapes (dummy
# weights); TOKENIZER_DIR: a Hugging Face tokenizer folder (the real one of
# that model: see docs/BENCHMARKS.md for where it comes from). RATEs default
# to "inf"; NUM_PROMPTS (1000), INPUT_LEN (512) and OUTPUT_LEN (128) set the workload
# (RATED_PROMPTS, default NUM_PROMPTS: the prompts of each finite rate's run);
# PROMPTS=text sends text prompts (as vLLM's benchmark does: the server
# tokenizes; the offline run gets the same text) instead of token ids;
# SERVER_ARGS go to the server (e.g. --api-server-count 2), TAG names such a
# run's files; SKIP_OFFLINE=1 leaves out the offline run; PROFILE_DELAY (2)
# and PROFILE_S (5) place the saturated window; TRACE=1 records the timeline
# of the processes (tools/gpu/trace: one RATE per call) and prints it binned,
# online beside offline. Needs the server's packages (starlette, uvicorn,
# pydantic) and, for the profile, py-spy on PATH. Logs and JSON go to $OUT (default
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
text=()  # PROMPTS=text: online and offline alike
[[ ${PROMPTS:-ids} == text ]] && text=(--prompt-tokenizer "$tokenizer")
trace() {  # trace PHASE COMMAND...: the command, traced under TRACE=1. Only
  # called in a subshell (backgrounded or piped): exec keeps $! the process.
  if [[ ${TRACE:-0} == 1 ]]; then
    exec env PYTHONPATH="tools/gpu/trace:$PYTHONPATH" PAGODA_TRACE_DIR="$out/trace_$1" "${@:2}"
  fi
  exec "${@:2}"
}

trace "$name" python3 -m pagoda.entrypoints.openai.api_server --model "$model" --load-format dummy --tokenizer "$tokenizer" \
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
  # Random prompts are token ids of the model's vocabulary (its config); the server detokenizes.
  prompts=()
  [[ $rate != inf ]] && prompts=(--num-prompts "${RATED_PROMPTS:-${NUM_PROMPTS:-1000}}")
  prompts+=("${text[@]}")
  trace "$name" python3 -m pagoda.entrypoints.cli bench serve --port $port --model "$shape" --tokenizer "$model" \
    "${workload[@]}" "${prompts[@]}" --ignore-eos --request-rate "$rate" --disable-tqdm --save-result --result-dir "$out" \
    --result-filename "serve_${name}_rate_$rate.json" >"$out/client_${name}_rate_$rate.log" 2>&1 &
  client=$!
  watchers=()
  if [[ $rate == inf ]]; then
    # A window of the saturated run (PROFILE_DELAY s after the client starts
    # sending, PROFILE_S long): CPU per process (server, engine core, client:
    # which one is the bound), and py-spy (--idle off: only time spent
    # running) of the server tree and of the client.
    delay=${PROFILE_DELAY:-2} window=${PROFILE_S:-5} log="$out/client_${name}_rate_$rate.log"
    started() {  # the client imported, built its requests and started sending, $delay s ago
      until grep -q '^bench serve:' "$log"; do kill -0 $client 2>/dev/null || return 1; sleep 0.2; done
      sleep "$delay"
    }
    (started && python3 tools/gpu/proc_cpu.py --duration "$window" $server $client >"$out/cpu_$name.txt" 2>&1) &
    watchers+=($!)
    if command -v py-spy >/dev/null; then
      for target in server client; do
        (started && py-spy record --pid "${!target}" --subprocesses --nonblocking --duration "$window" --rate 200 --threads \
          --format raw --output "$out/profile_${name}_$target.txt" >"$out/py-spy_${name}_$target.log" 2>&1) &
        watchers+=($!)
      done
    fi
  fi
  wait $client
  tail -n 22 "$out/client_${name}_rate_$rate.log"
  [[ ${#watchers[@]} -gt 0 ]] && wait "${watchers[@]}"
done
kill $server; wait $server 2>/dev/null; trap - EXIT

[[ ${SKIP_OFFLINE:-0} == 1 ]] || trace "${name}_offline" python3 -m pagoda.entrypoints.cli bench throughput --model-shape "$shape" --tokenizer "$tokenizer" "${workload[@]}" \
  "${text[@]}" --disable-tqdm --output-json "$out/throughput_$name.json" 2>&1 | tail -n 2

cat "$out/cpu_$name.txt" 2>/dev/null
for phase in "$name" "${name}_offline"; do
  [[ -d $out/trace_$phase ]] && { echo "== timeline: $phase"; python3 tools/gpu/trace_summary.py "$out/trace_$phase"; }
done
for target in server client; do
  [[ -f $out/profile_${name}_$target.txt ]] && python3 tools/gpu/profile_summary.py "$out/profile_${name}_$target.txt"
done
