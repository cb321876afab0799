"""quantization="fp8" end to end on every family's tiny random checkpoint:
the linear layers' weights become e4m3 with per-channel scales, the rest
keeps the model's dtype, and generation follows the same weights in bf16 up
to near ties (the real SmolLM2's check is in test_smollm2.py); what the
configuration refuses."""

import pytest
import torch
from agreement import assert_agree_up_to_near_tie
from checkpoints import CONFIGS

from pagoda import LLM, SamplingParams
from pagoda.model_executor.layers.linear import LinearBase

PROMPTS = [[1, 5, 9, 14, 3], [7] * 12, list(range(20, 50)), [2, 200, 31, 4, 77, 150, 9, 18]]
TOKENS = 32
# Random weights leave near ties everywhere (the greedy paths part within the
# first 5 tokens on most prompts, as bf16 and fp32 do), so only the ties'
# closeness is held. Measured: the prompts' mean logprob drift 0.002-0.16
# nats, single positions up to 0.55, gaps where the paths part up to 0.45.
NEAR_TIE = 1.0
MAX_DRIFT = 0.3


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_fp8_follows_bf16(make_checkpoint, family):
    _, folder = make_checkpoint(family)
    bf16 = LLM(folder, device="cpu", dtype="bfloat16", kv_cache_space=0.01)
    fp8 = LLM(folder, device="cpu", dtype="bfloat16", quantization="fp8", kv_cache_space=0.01)
    assert fp8.llm_engine.model_config.quantization == "fp8"
    model = fp8.llm_engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    assert linears and all(m.weight.dtype == torch.float8_e4m3fn for m in linears)
    assert all(m.weight.fp8_scale.shape == (1, m.weight.shape[0]) for m in linears)
    others = [p for name, p in model.named_parameters() if not any(p is m.weight for m in linears)]
    assert others and all(p.dtype == torch.bfloat16 for p in others)
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True, logprobs=20, prompt_logprobs=0)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    outputs = zip(fp8.generate(prompts, params, use_tqdm=False), bf16.generate(prompts, params, use_tqdm=False))
    drifts = [assert_agree_up_to_near_tie(got, want, NEAR_TIE, MAX_DRIFT) for got, want in outputs]
    assert max(drifts) > 0  # the weights were quantized


def test_fp8_norms_and_activation_quantize_for_their_linears(make_checkpoint):
    """The norms and the activation that feed an FP8 linear hand it e4m3 rows
    (fp8_output): on the CPU the same ops as the linear's own quantization,
    so the same logprobs to the bit as with the flags cleared; the final norm,
    which feeds the bf16 LM head, and Qwen3's head norms are left alone."""
    _, folder = make_checkpoint("qwen3")
    llm = LLM(folder, device="cpu", dtype="bfloat16", quantization="fp8", kv_cache_space=0.01)
    model = llm.llm_engine.runner.model
    layers = model.model.layers
    producers = [m for layer in layers for m in (layer.input_layernorm, layer.post_attention_layernorm, layer.mlp.act_fn)]
    assert all(m.fp8_output for m in producers)
    assert not model.model.norm.fp8_output
    assert not any(layer.self_attn.q_norm.fp8_output or layer.self_attn.k_norm.fp8_output for layer in layers)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5, prompt_logprobs=5)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    fused = llm.generate(prompts, params, use_tqdm=False)
    for m in producers:
        m.fp8_output = False
    for got, want in zip(fused, llm.generate(prompts, params, use_tqdm=False)):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert got.prompt_logprobs == want.prompt_logprobs and got.outputs[0].logprobs == want.outputs[0].logprobs


def test_fp8_configuration_errors(make_checkpoint):
    _, folder = make_checkpoint("llama")
    with pytest.raises(ValueError, match="dtype"):
        LLM(folder, device="cpu", dtype="float32", quantization="fp8", kv_cache_space=0.01)
    with pytest.raises(ValueError, match="quantization must be one of"):
        LLM(folder, device="cpu", dtype="bfloat16", quantization="int3", kv_cache_space=0.01)
    # The float8 KV cache's kernels are CUDA's (tests/ops/test_fp8_kv_cache.py, tests/gpu).
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8' needs a CUDA GPU"):
        LLM(folder, device="cpu", dtype="bfloat16", kv_cache_dtype="fp8", kv_cache_space=0.01)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        LLM(folder, device="cpu", kv_cache_dtype="int8", kv_cache_space=0.01)


def test_fp8_two_ranks_follow_one(make_checkpoint):
    """Under tensor parallelism each rank quantizes its own shard: a row
    parallel layer's rank holds half of each weight row, so its scales (and
    the activations' per-token scales over its half) differ from one rank's;
    the result follows the one-rank FP8 model as FP8 follows bf16."""
    _, folder = make_checkpoint("llama")
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True, logprobs=20, prompt_logprobs=0)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    one = LLM(folder, device="cpu", dtype="bfloat16", quantization="fp8", kv_cache_space=0.01)
    two = LLM(folder, device="cpu", dtype="bfloat16", quantization="fp8", kv_cache_space=0.01, tensor_parallel_size=2)
    try:
        for got, want in zip(two.generate(prompts, params, use_tqdm=False), one.generate(prompts, params, use_tqdm=False)):
            assert_agree_up_to_near_tie(got, want, NEAR_TIE, MAX_DRIFT)
    finally:
        two.llm_engine.shutdown()
