"""int8 weights (model_executor/layers/int8.py, --quantization int8) against
their definition: Q8_0 grouped blocks whose rounding stays within half a
step of the group's fp16 scale, and which parameters quantize_int8_weights
turns to them (linear layers and the LM head, from floats or from GGUF
blocks; in_features not a multiple of 32 kept), multiplied as the reference
does on the int8-rounded input."""

import pytest
import torch
from torch import nn

from pagoda import LLM, SamplingParams, ops
from pagoda.config import ModelConfig
from pagoda.model_executor.layers.int8 import quantize_int8_weights, quantize_q8_0_grouped
from pagoda.model_executor.layers.linear import MergedColumnParallelLinear, ReplicatedLinear, RowParallelLinear, dense
from pagoda.model_executor.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from pagoda.model_executor.weight_utils import PackedWeight, pack_parameter

from checkpoints import CONFIGS, build_hf_model, save_checkpoint


@pytest.mark.parametrize("cols", [32, 96, 352, 576, 1536])
def test_quantize_q8_0_grouped_rounds_within_half_a_step(cols):
    torch.manual_seed(cols)
    w = torch.randn(7, cols) * torch.logspace(-3, 2, 7).unsqueeze(1)
    w[1] = 0
    w[2, 5] = 40.0  # an outlier sets its group's scale
    blocks = quantize_q8_0_grouped(w)
    assert blocks.dtype == torch.uint8 and blocks.shape == (7, cols // 32 * 34)
    group = ops.q8_0_group_blocks(cols)
    scales = blocks.view(7, -1, 34)[..., :2].contiguous().view(torch.float16).float().view(7, -1)
    # One scale per group: each group's blocks carry the same d, max|w| / 127
    # to fp16's rounding (half an ulp; 2^-25 absolute among its subnormals,
    # where the 1e-3 row's scales fall).
    per_group = scales.view(7, -1, group)
    assert torch.equal(per_group, per_group[..., :1].expand_as(per_group))
    amax = w.view(7, -1, 32 * group).abs().amax(-1)
    torch.testing.assert_close(per_group[..., 0], amax / 127, rtol=2**-11, atol=2**-25)
    q = blocks.view(7, -1, 34)[..., 2:].contiguous().view(torch.int8)
    assert q.abs().max() <= 127 and torch.equal(q[1], torch.zeros_like(q[1]))
    back = ops.gguf_dequantize_reference(blocks, ops.Q8_0_GROUPED)
    step = per_group[..., :1].expand(-1, -1, 32 * group).reshape(7, cols)
    assert torch.all((back - w).abs() <= step / 2 * (1 + 2**-10) + 1e-30)


def test_quantize_q8_0_grouped_rejects_what_it_cannot_hold():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_q8_0_grouped(torch.randn(2, 48))
    with pytest.raises(ValueError, match="not finite or beyond"):
        quantize_q8_0_grouped(torch.tensor([[float("inf")] + [0.0] * 31]))
    with pytest.raises(ValueError, match="not finite or beyond"):
        quantize_q8_0_grouped(torch.full((1, 32), 1e7))


def test_quantize_int8_weights_converts_linears_and_the_lm_head():
    torch.manual_seed(0)
    model = nn.ModuleDict({
        "up": MergedColumnParallelLinear(64, [32, 48], dtype=torch.float32),
        "down": RowParallelLinear(96, 40, bias=True, dtype=torch.float32),
        "odd": ReplicatedLinear(48, 8, dtype=torch.float32),
        "packed": ReplicatedLinear(64, 24, dtype=torch.float32),
        "embed": VocabParallelEmbedding(100, 64, dtype=torch.float32),
        "lm_head": ParallelLMHead(100, 64, dtype=torch.float32),
    })
    for p in model.parameters():
        p.data.normal_()
    model["lm_head"].tie_weights(model["embed"])
    # A weight the GGUF loader left packed in the file's Q4_1 blocks.
    q4_1 = ops.gguf_random_blocks(24, 64, 3)
    pack_parameter(model["packed"].weight, PackedWeight(q4_1, 3, (24, 64)))
    model["packed"].weight.data.copy_(q4_1)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    before["packed.weight"] = ops.gguf_dequantize_reference(q4_1, 3)
    table = model["embed"].weight.detach().clone()

    assert quantize_int8_weights(model) == (4, 1)  # up, down, packed, the tied table once; odd kept
    assert model["odd"].weight.dtype == torch.float32 and getattr(model["odd"].weight, "gguf_type", None) is None
    assert model["down"].bias.dtype == torch.float32
    for name, k in [("up", 64), ("down", 96), ("packed", 64), ("lm_head", 64)]:
        weight = model[name].weight
        assert weight.gguf_type == ops.Q8_0_GROUPED and weight.gguf_quantize_input and weight.dtype == torch.uint8
        blocks = ops.gguf_from_panels_reference(weight.data, ops.Q8_0_GROUPED)
        want = quantize_q8_0_grouped(before.get(f"{name}.weight", table))
        assert torch.equal(blocks, want)
        x = torch.randn(5, k)
        bias = model[name].bias if name == "down" else None
        torch.testing.assert_close(dense(x, weight, bias),
                                   ops.gguf_linear_reference(x, blocks, ops.Q8_0_GROUPED, bias, quantize_input=True),
                                   rtol=1e-5, atol=1e-5)
    assert model["embed"].weight is model["lm_head"].weight
    ids = torch.tensor([0, 17, 99])
    torch.testing.assert_close(model["embed"](ids), ops.gguf_dequantize_reference(quantize_q8_0_grouped(table[ids]),
                                                                                   ops.Q8_0_GROUPED))


def test_int8_needs_the_cpu_in_float32(tmp_path):
    folder = save_checkpoint(build_hf_model("llama"), str(tmp_path))
    config = ModelConfig(folder, quantization="int8", device="cpu")
    assert config.quantization == "int8" and config.torch_dtype == torch.float32  # auto: fp32 for the kernels
    with pytest.raises(ValueError, match="quantization='int8' .* needs the CPU in float32"):
        ModelConfig(folder, quantization="int8", device="cpu", dtype="bfloat16")


# Measured on the tiny random checkpoints: 0.013-0.046 nats (20-token prompt).
FAMILY_MAX_DRIFT = 0.15  # nats


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_family_runs_int8_close_to_fp32(name, tmp_path):
    """quantization="int8" from a float checkpoint (safetensors) for every
    family, fused layer op or per-op path (Qwen3's q/k norms, OPT's biases
    and projections): the prompt's logprobs within FAMILY_MAX_DRIFT of fp32
    on average, and not equal (the weights were quantized). A wrong scale or
    group is off by whole nats."""
    folder = save_checkpoint(build_hf_model(name), str(tmp_path))
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    prompt = [{"prompt_token_ids": list(range(5, 25))}]
    logprobs = []
    for quantization in ("none", "int8"):
        llm = LLM(folder, skip_tokenizer_init=True, dtype="float32", kv_cache_space=0.05, quantization=quantization)
        out = llm.generate(prompt, params, use_tqdm=False)[0]
        logprobs.append([next(iter(p.values())).logprob for p in out.prompt_logprobs[1:]])
    drift = sum(abs(a - b) for a, b in zip(*logprobs)) / len(logprobs[0])
    assert 1e-4 < drift < FAMILY_MAX_DRIFT, drift
