"""`pagoda bench throughput` and `bench latency` end to end on a tiny random
checkpoint and on model shapes shrunk with --hf-overrides; the transformers
baseline's batching; the model shapes in the repo. Counts and structure are
checked, never speed."""

import json

import pytest
import torch

from pagoda.benchmarks.model_shapes import available_model_shapes, model_shape_path

# A model shape shrunk to run in a blink (vLLM's --hf-overrides).
TINY_OVERRIDES = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=512)
TINY = json.dumps(TINY_OVERRIDES)


def read_json(path):
    with open(path) as f:
        return json.load(f)


def test_throughput_with_hf_baseline(pagoda_cli, tiny_model, tmp_path):
    out = tmp_path / "throughput.json"
    code, stdout, stderr = pagoda_cli(
        "bench", "throughput", "--model", tiny_model, "--skip-tokenizer-init", "--dtype", "float32", "--device", "cpu",
        "--kv-cache-space", "0.05", "--num-prompts", "6", "--input-len", "12", "--output-len", "5",
        "--random-range-ratio", "0.5", "--hf-baseline", "--hf-batch-size", "4", "--output-json", out,
        "--disable-tqdm")
    assert code == 0, stderr
    result = read_json(out)
    spec = result["dataset"]
    assert spec["num_prompts"] == 6 and spec["input_len_range"] == [6, 18] and spec["output_len_range"] == [2, 7]
    pagoda, hf = result["pagoda"], result["hf"]
    # The same requests on both sides: the same token counts, each request
    # exactly its own output length (EOS ignored).
    for key in ("num_requests", "total_prompt_tokens", "total_output_tokens"):
        assert pagoda[key] == hf[key]
    assert pagoda["num_requests"] == 6
    assert 6 * 2 <= pagoda["total_output_tokens"] <= 6 * 7
    assert pagoda["total_num_tokens"] == pagoda["total_prompt_tokens"] + pagoda["total_output_tokens"]
    ratio = pagoda["output_tokens_per_second"] / hf["output_tokens_per_second"]
    assert result["pagoda_over_hf"] == pytest.approx(ratio)
    assert result["dtype"] == "torch.float32" and result["device"] == "cpu"
    assert "pagoda / hf output throughput" in stdout


@pytest.mark.parametrize("shape", ["Qwen3-0.6B", "Llama-3.1-8B"])
def test_throughput_on_a_shrunk_model_shape(pagoda_cli, tmp_path, shape):
    out = tmp_path / "shape.json"
    code, _, stderr = pagoda_cli(
        "bench", "throughput", "--model-shape", shape, "--hf-overrides", TINY, "--max-model-len", "128",
        "--kv-cache-space", "0.05", "--num-prompts", "3", "--input-len", "8", "--output-len", "3", "--hf-baseline",
        "--output-json", out, "--disable-tqdm")
    assert code == 0, stderr
    result = read_json(out)
    engine = result["engine_args"]
    assert engine["model"] == model_shape_path(shape)
    assert engine["load_format"] == "dummy" and engine["skip_tokenizer_init"] is True
    assert result["dtype"] == "torch.bfloat16"  # the shape's torch_dtype
    assert result["pagoda"]["total_output_tokens"] == result["hf"]["total_output_tokens"] == 9


def test_latency(pagoda_cli, tiny_model, tmp_path):
    out = tmp_path / "latency.json"
    code, stdout, stderr = pagoda_cli(
        "bench", "latency", "--model", tiny_model, "--skip-tokenizer-init", "--kv-cache-space", "0.05",
        "--batch-size", "3", "--input-len", "8", "--output-len", "4", "--num-iters-warmup", "1", "--num-iters", "4",
        "--output-json", out, "--disable-tqdm")
    assert code == 0, stderr
    result = read_json(out)
    assert len(result["latencies"]) == 4 and all(x > 0 for x in result["latencies"])
    assert result["avg_latency"] == pytest.approx(sum(result["latencies"]) / 4)
    values = [result["percentiles"][p] for p in ("10", "25", "50", "75", "90", "99")]
    assert values == sorted(values)
    assert min(result["latencies"]) <= values[0] and values[-1] <= max(result["latencies"])
    assert "Avg latency:" in stdout and "99% percentile latency:" in stdout


@pytest.mark.parametrize("argv, message", [
    (["--model", "x", "--model-shape", "Qwen3-0.6B"], "pass --model or --model-shape, not both"),
    (["--model-shape", "Qwen3-0.6B", "--load-format", "safetensors"], "needs --load-format dummy"),
    (["--model-shape", "Qwen3-0.6B", "--hf-overrides", TINY, "--max-model-len", "64", "--input-len", "60",
      "--output-len", "10"], "over max_model_len=64"),
    (["--model-shape", "Qwen3-0.6B", "--hf-overrides", TINY, "--tensor-parallel-size", "3"], "num_attention_heads"),
])
def test_bad_combinations_are_clear_errors(pagoda_cli, argv, message):
    code, _, stderr = pagoda_cli("bench", "throughput", "--kv-cache-space", "0.05", "--disable-tqdm", *argv)
    assert code == 2
    assert "pagoda bench throughput: error:" in stderr and message in stderr


@pytest.mark.parametrize("argv", [["--hf-overrides", "[1]"], ["--hf-overrides", "{"], ["--model-shape", "GPT-5"],
                                  ["--kv-cache-space", "0"], ["--hf-batch-size", "0"]])
def test_bad_flags_are_argparse_errors(pagoda_cli, argv):
    code, _, stderr = pagoda_cli("bench", "throughput", *argv)
    assert code == 2 and argv[0] in stderr


def test_hf_baseline_pads_left_and_counts_own_lengths(tiny_model):
    """A left-padded batch gives each prompt the continuation it gets alone,
    and each request counts only its own output length."""
    from checkpoints import hf_greedy

    from pagoda.benchmarks.datasets import SampleRequest
    from pagoda.benchmarks.hf_baseline import left_pad, load_hf_model, run_hf
    from pagoda.config import ModelConfig

    config = ModelConfig(tiny_model, dtype="float32")
    model = load_hf_model(config, torch.device("cpu"))
    prompts = [[5, 6, 7, 8, 9, 10, 11], [20, 21], [30, 31, 32, 33]]
    input_ids, attention_mask = left_pad([SampleRequest(p, 1) for p in prompts], 0, torch.device("cpu"))
    assert attention_mask.tolist()[1] == [0, 0, 0, 0, 0, 1, 1] and input_ids.tolist()[1][-2:] == [20, 21]
    batch_out = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=5, min_new_tokens=5,
                               do_sample=False, eos_token_id=None, pad_token_id=0)
    for row, prompt in enumerate(prompts):
        assert batch_out[row, -5:].tolist() == hf_greedy(model, prompt, 5)
    requests = [SampleRequest(p, n) for p, n in zip(prompts, [5, 1, 3])]
    elapsed, tokens = run_hf(model, requests, batch_size=2, temperature=0.0, use_tqdm=False)
    assert tokens == 9 and elapsed > 0


def test_repeated_timed_runs_each_compute_their_prompts(tiny_model):
    """Against peers, Pagoda's throughput is the median of as many runs as
    theirs, and no run finds the prompts the one before it computed."""
    import statistics

    from pagoda import LLM
    from pagoda.benchmarks.datasets import SampleRequest
    from pagoda.benchmarks.throughput import run_pagoda

    llm = LLM(tiny_model, skip_tokenizer_init=True, dtype="float32", device="cpu", kv_cache_space=0.05,
              block_size=4)
    generate, cached = llm.generate, []

    def recording(*args, **kwargs):
        outputs = generate(*args, **kwargs)
        cached.append([o.num_cached_tokens for o in outputs])
        return outputs

    llm.generate = recording
    requests = [SampleRequest(list(range(10 + i, 30 + i)), 3) for i in range(3)]
    figures, prompts = run_pagoda(llm, requests, [SampleRequest([1, 2, 3], 2)], 0.0, use_tqdm=False, runs=3)
    assert cached[1:] == [[0, 0, 0]] * 3  # after the warm-up, three timed runs, none served from the cache
    assert len(figures["runs"]) == 3
    assert figures["elapsed_time"] == statistics.median(r["elapsed_time"] for r in figures["runs"])
    assert figures["total_output_tokens"] == 9 and prompts == [r.prompt_token_ids for r in requests]


def test_dummy_hf_model_has_the_shape():
    from pagoda.benchmarks.hf_baseline import load_hf_model
    from pagoda.config import ModelConfig

    config = ModelConfig(model_shape_path("Qwen3-0.6B"), load_format="dummy", hf_overrides=TINY_OVERRIDES)
    model = load_hf_model(config, torch.device("cpu"))
    assert model.dtype == torch.bfloat16 and type(model).__name__ == "Qwen3ForCausalLM"
    assert model.config.num_hidden_layers == 2 and model.config.vocab_size == 512


def test_model_shapes_in_the_repo():
    """Each folder is a config.json transformers loads, with the public
    model's values; Llama-3.1's llama3 rope scaling gives transformers' own
    inverse frequencies in our rotary embedding."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from pagoda.model_executor.layers.rotary_embedding import _default_inv_freq, _llama3_inv_freq
    from pagoda.model_executor.layers.rotary_embedding import rope_parameters_from_config

    assert {"Qwen3-0.6B", "Llama-3.1-8B", "Qwen2.5-0.5B", "SmolLM2-135M"} <= set(available_model_shapes())
    qwen3 = AutoConfig.from_pretrained(model_shape_path("Qwen3-0.6B"))
    assert (qwen3.model_type, qwen3.hidden_size, qwen3.num_hidden_layers, qwen3.head_dim, qwen3.vocab_size) == (
        "qwen3", 1024, 28, 128, 151936)
    llama = AutoConfig.from_pretrained(model_shape_path("Llama-3.1-8B"))
    assert (llama.hidden_size, llama.num_hidden_layers, llama.num_key_value_heads, llama.vocab_size) == (
        4096, 32, 8, 128256)
    theta, scaling, partial = rope_parameters_from_config(llama)
    assert theta == 500000.0 and partial == 1.0 and scaling["rope_type"] == "llama3" and scaling["factor"] == 8.0
    ours = _llama3_inv_freq(_default_inv_freq(theta, 128), scaling, llama.max_position_embeddings)
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](llama, "cpu")
    torch.testing.assert_close(ours, theirs.float(), rtol=0, atol=0)
    assert not torch.equal(ours, _default_inv_freq(theta, 128))  # the scaling does change long wavelengths


def test_throughput_of_text_prompts(pagoda_cli, tiny_model, tmp_path):
    """--prompt-tokenizer: the random ids decoded to text, which the engine
    encodes again inside the timed run; the prompt tokens reported are the
    engine's, and the baseline runs those same tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerFast

    from pagoda.benchmarks.datasets import DatasetSpec, RandomDataset, special_token_ids

    # Byte-level, no merges: 256 ids, the tiny model's vocabulary.
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(tmp_path / "tok")
    out = tmp_path / "text.json"
    code, _, stderr = pagoda_cli(
        "bench", "throughput", "--model", tiny_model, "--tokenizer", tmp_path / "tok", "--dtype", "float32",
        "--device", "cpu", "--kv-cache-space", "0.05", "--num-prompts", "4", "--input-len", "10", "--output-len", "3",
        "--prompt-tokenizer", tmp_path / "tok", "--hf-baseline", "--output-json", out, "--disable-tqdm")
    assert code == 0, stderr
    result = read_json(out)
    hf_tokenizer = AutoTokenizer.from_pretrained(tmp_path / "tok")
    special = special_token_ids(AutoConfig.from_pretrained(tiny_model))
    ids = RandomDataset(256, 0, special).sample(DatasetSpec(4, (10, 10), (3, 3)))
    texts = hf_tokenizer.batch_decode([r.prompt_token_ids for r in ids])
    encoded = sum(len(hf_tokenizer(t)["input_ids"]) for t in texts)
    assert encoded != 4 * 10  # random bytes do not all decode to themselves: the count is the engine's
    assert result["pagoda"]["total_prompt_tokens"] == result["hf"]["total_prompt_tokens"] == encoded
    assert result["pagoda"]["total_output_tokens"] == result["hf"]["total_output_tokens"] == 12
