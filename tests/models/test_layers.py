"""Layers on their own: RoPE tables against transformers', config parsing,
fused weight loading, norms, the registry."""

import types

import pytest
import torch
import transformers
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from pagoda import ops
from pagoda.model_executor.layers.layernorm import RMSNorm
from pagoda.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear
from pagoda.model_executor.layers.rotary_embedding import get_rope, rope_parameters_from_config
from pagoda.model_executor.models.registry import get_model_class, supported_architectures
from pagoda.model_executor.weight_utils import load_named_weights

ROPE_SCALINGS = {
    "default": None,
    "linear": dict(rope_type="linear", factor=4.0),
    "llama3": dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
    ),
}


@pytest.mark.parametrize("rope_type", list(ROPE_SCALINGS))
def test_rope_table_matches_transformers(rope_type):
    config = transformers.LlamaConfig(
        hidden_size=256, num_attention_heads=2, max_position_embeddings=512, rope_theta=50000.0,
        rope_scaling=ROPE_SCALINGS[rope_type],
    )
    theta, scaling, partial = rope_parameters_from_config(config)
    assert (theta, partial) == (50000.0, 1.0) and (scaling or {}).get("rope_type", "default") == rope_type
    rope = get_rope(128, 128, 512, theta, True, scaling, torch.bfloat16)
    assert rope.cos_sin_cache.dtype == torch.float32 and rope.cos_sin_cache.shape == (512, 128)
    positions = torch.arange(512)[None]
    cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), positions)
    torch.testing.assert_close(rope.cos_sin_cache, torch.cat([cos[0, :, :64], sin[0, :, :64]], -1), rtol=0, atol=1e-6)


def test_rope_parameters_of_old_style_configs():
    old = types.SimpleNamespace(rope_theta=1e6, rope_scaling={"type": "linear", "factor": 2.0})
    assert rope_parameters_from_config(old) == (1e6, {"type": "linear", "factor": 2.0, "rope_type": "linear"}, 1.0)
    assert rope_parameters_from_config(types.SimpleNamespace(rope_scaling=None)) == (10000.0, None, 1.0)


def test_rope_rejects_unknown_scaling():
    with pytest.raises(ValueError, match="unsupported rope scaling type 'yarn'"):
        get_rope(64, 64, 128, 10000.0, True, {"rope_type": "yarn", "factor": 2.0})


def test_get_rope_shares_one_table():
    assert get_rope(64, 64, 128, 10000.0) is get_rope(64, 64, 128, 10000.0)


def test_qkv_weight_loader_places_parts_and_biases():
    layer = QKVParallelLinear(8, head_size=2, total_num_heads=4, total_num_kv_heads=2, bias=True, dtype=torch.float32)
    parts = {"q": torch.randn(8, 8), "k": torch.randn(4, 8), "v": torch.randn(4, 8)}
    biases = {"q": torch.randn(8), "k": torch.randn(4), "v": torch.randn(4)}
    for shard in "qkv":
        layer.weight.weight_loader(layer.weight, parts[shard], shard)
        layer.bias.weight_loader(layer.bias, biases[shard], shard)
    x = torch.randn(3, 8)
    want = torch.cat([torch.nn.functional.linear(x, parts[s], biases[s]) for s in "qkv"], -1)
    torch.testing.assert_close(layer(x), want)


def test_load_named_weights_catches_missing_shards_and_strays():
    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up_proj = MergedColumnParallelLinear(4, [6, 6], dtype=torch.float32)

    mapping = [("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1)]
    with pytest.raises(ValueError, match=r"missing .*gate_up_proj.weight \(1\)"):
        load_named_weights(Tiny(), [("gate_proj.weight", torch.zeros(6, 4))], mapping)
    with pytest.raises(ValueError, match="unexpected weight 'down_proj.weight'"):
        load_named_weights(Tiny(), [("down_proj.weight", torch.zeros(4, 6))], mapping)
    with pytest.raises(ValueError, match=r"cannot load 'up_proj.weight'.*shape mismatch"):
        load_named_weights(Tiny(), [("up_proj.weight", torch.zeros(5, 4))], mapping)
    tiny = Tiny()
    load_named_weights(tiny, [("gate_proj.weight", torch.ones(6, 4)), ("up_proj.weight", torch.zeros(6, 4))], mapping)
    assert tiny.gate_up_proj.weight[:6].eq(1).all() and tiny.gate_up_proj.weight[6:].eq(0).all()
    assert not tiny.gate_up_proj.weight.requires_grad


def test_rms_norm_with_residual_is_add_then_norm():
    norm = RMSNorm(16, 1e-6, torch.float32)
    norm.weight.data.uniform_(0.5, 1.5)
    x, residual = torch.randn(5, 16), torch.randn(5, 16)
    want_out, want_residual = ops.fused_add_rms_norm_reference(x, residual, norm.weight, 1e-6)
    out, new_residual = norm(x.clone(), residual.clone())
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(new_residual, want_residual)


def test_registry():
    assert get_model_class(transformers.MistralConfig()).__name__ == "LlamaForCausalLM"
    gguf_like = transformers.Qwen2Config()  # configs built from GGUF files have no architectures
    assert getattr(gguf_like, "architectures", None) is None
    assert get_model_class(gguf_like).__name__ == "Qwen2ForCausalLM"
    assert "OPTForCausalLM" in supported_architectures()
    config = transformers.GPT2Config(architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match=r"unsupported model architecture \['GPT2LMHeadModel'\].*supported: Llama"):
        get_model_class(config)
