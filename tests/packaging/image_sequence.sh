#!/usr/bin/env bash
# The CPU image's install-and-serve sequence (docker/pagoda-image.sh, which
# docker/cpu.Dockerfile runs) on this machine, in a fresh venv outside the
# checkout: the Bazel-built CPU wheel installs with its requirements, `pip
# check` is clean, and `pagoda serve` answers /health and a chat completion
# with SmolLM2. Run by .ci/run: it builds with Bazel, which cannot run inside
# a Bazel test.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "${root}"

SECONDS=0
tools/bazel build //:wheel >/dev/null 2>&1 || tools/bazel build //:wheel
echo "image_sequence: wheel built in ${SECONDS} s"
wheel="$(ls bazel-bin/wheel/*.whl)"
home="$(mktemp -d)"
server=""
cleanup() {
  if [[ -n "${server}" ]]; then kill "${server}" 2>/dev/null || true; wait "${server}" 2>/dev/null || true; fi
  rm -rf "${home}"
}
trap cleanup EXIT

# The interpreter the wheel was built for (its tags say which).
python="$(.venv/bin/python3 -c 'import sys; print(sys._base_executable)')"
echo "image_sequence: installing ${wheel##*/} into a fresh venv in ${home}"
cp "${wheel}" requirements-models.txt docker/pagoda-image.sh "${home}/"
cd "${home}"  # nothing of the checkout on sys.path from here on
unset PYTHONPATH
SECONDS=0
PAGODA_HOME="${home}" PAGODA_PYTHON="${python}" ./pagoda-image.sh install "${home}/${wheel##*/}" requirements-models.txt
echo "image_sequence: installed in ${SECONDS} s"
SECONDS=0

"${home}/venv/bin/python" - "${root}" <<'PY'
import os, sys
import pagoda
where = os.path.realpath(pagoda.__file__)
assert not where.startswith(os.path.realpath(sys.argv[1]) + os.sep), f"pagoda imported from the checkout: {where}"
print("image_sequence: pagoda", pagoda.__version__, "from", os.path.dirname(where))
PY

port="$("${home}/venv/bin/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
PAGODA_HOME="${home}" PAGODA_PORT="${port}" ./pagoda-image.sh serve --host 127.0.0.1 --disable-log-requests >"${home}/serve.log" 2>&1 &
server=$!

"${home}/venv/bin/python" - "${port}" "${server}" <<'PY' || { tail -n 30 "${home}/serve.log"; exit 1; }
import json, os, sys, time, urllib.error, urllib.request

port, server = sys.argv[1], int(sys.argv[2])
base = f"http://127.0.0.1:{port}"
deadline = time.monotonic() + 300
while True:
    try:
        with urllib.request.urlopen(base + "/health", timeout=5) as response:
            if response.status == 200:
                break
    except (urllib.error.URLError, ConnectionError):
        pass
    os.kill(server, 0)  # the server must still be running
    if time.monotonic() > deadline:
        raise SystemExit("image_sequence: no /health 200 within 300 s")
    time.sleep(1)
with urllib.request.urlopen(base + "/v1/models", timeout=5) as response:
    model = json.load(response)["data"][0]["id"]
assert model.endswith("SmolLM2-135M-Instruct.Q4_1.gguf"), model
body = {"model": model, "temperature": 0, "max_tokens": 16,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]}
request = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
with urllib.request.urlopen(request, timeout=120) as response:
    answer = json.load(response)["choices"][0]["message"]["content"]
print(f"image_sequence: chat completion: {answer!r}")
assert "Paris" in answer, answer
PY

kill -TERM "${server}"
wait "${server}"
server=""
echo "image_sequence: served and answered in ${SECONDS} s"
echo "image_sequence: OK"
