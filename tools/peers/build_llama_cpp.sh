#!/usr/bin/env bash
# Builds llama.cpp's llama-batched-bench for `pagoda bench throughput|latency
# --compare llama.cpp`, from the llama.cpp source vendored in the pinned
# llama-cpp-python sdist (PyPI), natively for this CPU (GGML_NATIVE).
#
#   tools/peers/build_llama_cpp.sh [DEST]    # default: ~/.cache/pagoda/llama.cpp-<version>
#
# Prints the binary's path; `pagoda bench ... --llama-cpp-bin PATH` (or
# PAGODA_LLAMA_CPP_BIN) points the benchmark at it. llama-quantize lands beside
# it (K-quant files for tests/models/test_gguf.py). Takes a few minutes on 2 cores.
set -euo pipefail
version=0.3.36  # llama-cpp-python; its vendor/llama.cpp is the source built
dest=${1:-${XDG_CACHE_HOME:-$HOME/.cache}/pagoda/llama.cpp-$version}
python=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$python" -m pip download --quiet --no-binary :all: --no-deps "llama-cpp-python==$version" -d "$work"
tar xzf "$work/llama_cpp_python-$version.tar.gz" -C "$work"
src="$work/llama_cpp_python-$version/vendor/llama.cpp"
cmake -S "$src" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DBUILD_SHARED_LIBS=OFF >&2
cmake --build "$work/build" --target llama-batched-bench llama-quantize -j "${JOBS:-$(nproc)}" >&2
mkdir -p "$dest"
cp "$work/build/bin/llama-batched-bench" "$work/build/bin/llama-quantize" "$dest/"
echo "$dest/llama-batched-bench"
