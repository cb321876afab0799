"""`pagoda bench serve` against the real server on a loopback port: every
request completes, token counts are the workload's, and vLLM's metrics agree
with each other (TTFT + ITLs = E2EL, TTFT <= E2EL, throughput = count /
duration). calculate_metrics on hand-made outputs checks the definitions."""

import json

import pytest

from pagoda.benchmarks.datasets import DatasetSpec, RandomDataset, special_token_ids
from pagoda.benchmarks.serve import RequestFuncOutput, calculate_metrics
from pagoda.config import ModelConfig


def bench(pagoda_cli, url, tmp_path, *argv):
    out = tmp_path / "serve.json"
    code, stdout, stderr = pagoda_cli("bench", "serve", "--base-url", url, "--ignore-eos", "--disable-tqdm",
                                      "--result-file", out, *argv)
    assert code == 0, stderr
    return json.loads(out.read_text()), stdout


@pytest.mark.parametrize("load", [["--request-rate", "inf", "--max-concurrency", "2"],
                                  ["--request-rate", "40", "--burstiness", "0.5"]])
def test_metrics_are_consistent(pagoda_cli, server_url, tiny_model, tmp_path, load):
    result, stdout = bench(pagoda_cli, server_url, tmp_path, "--tokenizer", tiny_model, "--num-prompts", "6",
                           "--input-len", "10", "--output-len", "5", "--random-range-ratio", "0.4", "--seed", "3",
                           "--metric-percentiles", "50,90,99", *load)
    # The workload the benchmark drew, from the same seed and vocabulary.
    config = ModelConfig(tiny_model).hf_config
    requests = RandomDataset(config.vocab_size, 3, special_token_ids(config)).sample(DatasetSpec(6, (6, 14), (3, 7)))
    assert result["completed"] == 6 and result["failed"] == 0 and result["model_id"] == "tiny"
    assert result["input_lens"] == [r.prompt_len for r in requests]  # the server's usage numbers
    assert result["output_lens"] == [r.expected_output_len for r in requests]
    assert result["total_input_tokens"] == sum(result["input_lens"])
    assert result["total_output_tokens"] == sum(result["output_lens"])
    duration = result["duration"]
    assert result["request_throughput"] == pytest.approx(6 / duration)
    assert result["output_throughput"] == pytest.approx(result["total_output_tokens"] / duration)
    assert result["total_token_throughput"] == pytest.approx(
        (result["total_input_tokens"] + result["total_output_tokens"]) / duration)
    for ttft, itl, e2el, n in zip(result["ttfts"], result["itls"], result["e2els"], result["output_lens"]):
        assert 0 < ttft <= e2el <= duration
        assert len(itl) <= n - 1 and all(gap >= 0 for gap in itl)
        assert ttft + sum(itl) == pytest.approx(e2el)
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert result[f"median_{name}_ms"] == result[f"p50_{name}_ms"]
        assert 0 <= result[f"p50_{name}_ms"] <= result[f"p90_{name}_ms"] <= result[f"p99_{name}_ms"]
    assert result["mean_ttft_ms"] <= result["mean_e2el_ms"]
    for line in ("Successful requests:", "Mean TTFT (ms):", "P99 TPOT (ms):", "Median ITL (ms):", "P90 E2EL (ms):"):
        assert line in stdout


def test_errors_are_clear(pagoda_cli, server_url, tiny_model, tmp_path):
    code, _, stderr = pagoda_cli("bench", "serve", "--base-url", server_url, "--tokenizer", tiny_model, "--model",
                                 "nope", "--num-prompts", "2", "--input-len", "4", "--output-len", "2",
                                 "--disable-tqdm")
    assert code == 2 and "initial test request" in stderr and "404" in stderr
    code, _, stderr = pagoda_cli("bench", "serve", "--base-url", server_url, "--tokenizer", tiny_model,
                                 "--num-prompts", "1", "--input-len", "200", "--output-len", "2", "--disable-tqdm")
    assert code == 2 and "initial test request" in stderr and "maximum context length" in stderr
    code, _, stderr = pagoda_cli("bench", "serve", "--base-url", server_url, "--percentile-metrics", "ttft,foo")
    assert code == 2 and "--percentile-metrics" in stderr
    code, _, stderr = pagoda_cli("bench", "serve", "--port", "1", "--num-prompts", "1")
    assert code == 2 and "could not list the models" in stderr
    code, _, stderr = pagoda_cli("bench", "serve", "--request-rate", "0")
    assert code == 2 and "--request-rate" in stderr


def test_metric_definitions():
    outputs = [
        RequestFuncOutput(success=True, prompt_len=10, output_tokens=3, ttft=0.1, itl=[0.2, 0.3], latency=0.6),
        RequestFuncOutput(success=True, prompt_len=20, output_tokens=1, ttft=0.4, itl=[], latency=0.4),
        RequestFuncOutput(success=False, error="HTTP 500"),
    ]
    m = calculate_metrics(outputs, duration=2.0, percentiles=[50])
    assert (m["completed"], m["failed"], m["total_input_tokens"], m["total_output_tokens"]) == (2, 1, 30, 4)
    assert m["request_throughput"] == 1.0 and m["output_throughput"] == 2.0 and m["total_token_throughput"] == 17.0
    assert m["mean_ttft_ms"] == pytest.approx(250) and m["median_ttft_ms"] == pytest.approx(250)
    # TPOT excludes the first token and skips one-token requests: (0.6 - 0.1) / 2.
    assert m["mean_tpot_ms"] == pytest.approx(250)
    assert m["mean_itl_ms"] == pytest.approx(250) and m["p50_itl_ms"] == pytest.approx(250)
    assert m["mean_e2el_ms"] == pytest.approx(500) and m["std_e2el_ms"] == pytest.approx(100)
    assert calculate_metrics(outputs[2:], 1.0, [99])["mean_ttft_ms"] == 0  # nothing completed


def test_text_prompts_are_the_ids_decoded(tmp_path):
    """--prompt-tokenizer: vLLM's random dataset sends text; the payload
    carries the decoded ids, and what the server encodes again."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from pagoda.benchmarks.datasets import SampleRequest, as_text
    from pagoda.benchmarks.serve import completion_payload

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 4,
                            trainers.BpeTrainer(vocab_size=280, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                show_progress=False))
    hf = PreTrainedTokenizerFast(tokenizer_object=tok)
    hf.save_pretrained(tmp_path)
    ids = hf.encode("the lazy dog jumps")
    [request] = as_text([SampleRequest(ids, 5)], str(tmp_path))
    assert request.prompt == "the lazy dog jumps" and request.prompt_token_ids == ids
    assert completion_payload("m", request, 0.0, True)["prompt"] == "the lazy dog jumps"
    assert completion_payload("m", SampleRequest(ids, 5), 0.0, True)["prompt"] == ids
