"""A model folder's config from Pagoda's own reading of config.json
(transformers_utils.hf_config) against transformers' AutoConfig of the same
folder: every supported model type as save_pretrained writes it, as
hand-written files (from the model type alone, all defaults, to a few sizes),
with transformers 4's names (torch_dtype, rope_theta, rope_scaling) and
nulls to derive; the model shapes the benchmarks use and three more public
models; the errors a broken file gets; other model types left to transformers; and the engine reading a
folder without importing transformers at all (in a fresh process): the
engine core's start waits for its config."""

import json

import pytest
import torch
import transformers
from checkpoints import CONFIGS
from config_parity import assert_same_config, imported_modules

from pagoda.benchmarks.hf_baseline import load_hf_model
from pagoda.benchmarks.model_shapes import model_shape_path
from pagoda.config import ModelConfig
from pagoda.model_executor.models.registry import get_model_class
from pagoda.transformers_utils.hf_config import HFConfig, load_hf_config

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "opt": "OPTForCausalLM"}
ROTARY_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# The sizes of a tiny model, written by hand: the rest is the class's default.
SHORT = {"vocab_size": 300, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "max_position_embeddings": 256}
SHORT_LLAMA_LIKE = {**SHORT, "intermediate_size": 128, "num_key_value_heads": 2}
SHORT_OPT = {**SHORT, "ffn_dim": 128}
# Hand-written variants: (model types, config.json's fields besides the short ones).
VARIANTS = {
    "class_defaults": (tuple(ARCHITECTURES), {}),  # model_type alone, no sizes: every default
    "short": (tuple(ARCHITECTURES), {}),
    "transformers_4_names": (ROTARY_TYPES, {"torch_dtype": "float16", "rope_theta": 1e6,
                                            "rope_scaling": {"type": "linear", "factor": 2.0}}),
    "both_dtype_names": (tuple(ARCHITECTURES), {"dtype": "float32", "torch_dtype": "bfloat16"}),
    "llama3_rope_without_original_length": (ROTARY_TYPES, {"rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}}),
    "rope_parameters_and_partial_factor": (ROTARY_TYPES, {"rope_parameters": {"rope_type": "default",
                                                                              "rope_theta": 20000.0},
                                                          "partial_rotary_factor": 0.5}),
    # Each class's fields that may be null (transformers refuses the others).
    "nulls_llama": (("llama",), {"num_key_value_heads": None, "head_dim": None, "rope_parameters": None}),
    "nulls_mistral": (("mistral",), {"head_dim": None, "rope_parameters": None}),
    "nulls_qwen": (("qwen2", "qwen3"), {"num_key_value_heads": None, "dtype": None, "torch_dtype": "bfloat16"}),
    "nulls_opt": (("opt",), {"word_embed_proj_dim": None}),
    # Qwen2.5's files: a window that applies only with use_sliding_window.
    "sliding_window": (("mistral", "qwen2", "qwen3"), {"use_sliding_window": False, "sliding_window": 64}),
    "unused_keys": (tuple(ARCHITECTURES), {"transformers_version": "4.45.0", "initializer_range": 0.01,
                                           "quantization_config": {"quant_method": "fp8"}}),
}


def write_config(folder, fields: dict):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(fields))
    return folder


def assert_same_as_transformers(folder):
    ours = load_hf_config(folder)
    assert isinstance(ours, HFConfig)
    assert_same_config(ours, transformers.AutoConfig.from_pretrained(folder))
    assert isinstance(ModelConfig(model=str(folder), device="cpu").hf_config, HFConfig)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_saved_configs_match_transformers(tmp_path, name):
    """Every tiny checkpoint family of the model tests, as save_pretrained writes its config."""
    CONFIGS[name]().save_pretrained(tmp_path)
    assert_same_as_transformers(tmp_path)


@pytest.mark.parametrize("variant, model_type", [(variant, model_type) for variant, (types, _) in VARIANTS.items()
                                                 for model_type in types])
def test_hand_written_configs_match_transformers(tmp_path, variant, model_type):
    sizes = {} if variant == "class_defaults" else SHORT_OPT if model_type == "opt" else SHORT_LLAMA_LIKE
    fields = {"architectures": [ARCHITECTURES[model_type]], "model_type": model_type, **sizes, **VARIANTS[variant][1]}
    assert_same_as_transformers(write_config(tmp_path, fields))


@pytest.mark.parametrize("shape", ["Llama-3.1-8B", "Qwen2.5-0.5B", "Qwen3-0.6B", "SmolLM2-135M"])
def test_model_shapes_match_transformers(shape):
    assert_same_as_transformers(model_shape_path(shape))


# Public models' config.json values beyond the benchmark shapes.
PUBLIC_CONFIGS = {
    "Mistral-7B-v0.1": {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 4096,
                        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                        "num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 32768,
                        "rope_theta": 10000.0, "rms_norm_eps": 1e-05, "sliding_window": 4096,
                        "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "bfloat16"},
    "Qwen2.5-7B": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
                   "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
                   "num_key_value_heads": 4, "vocab_size": 152064, "max_position_embeddings": 131072,
                   "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "tie_word_embeddings": False,
                   "hidden_act": "silu", "torch_dtype": "bfloat16"},
    "OPT-125m": {"architectures": ["OPTForCausalLM"], "model_type": "opt", "hidden_size": 768, "ffn_dim": 3072,
                 "num_hidden_layers": 12, "num_attention_heads": 12, "vocab_size": 50272,
                 "max_position_embeddings": 2048, "word_embed_proj_dim": 768, "do_layer_norm_before": True,
                 "activation_function": "relu", "enable_bias": True, "torch_dtype": "float16", "bos_token_id": 2,
                 "eos_token_id": 2, "pad_token_id": 1},
}


@pytest.mark.parametrize("name", sorted(PUBLIC_CONFIGS))
def test_public_configs_match_transformers(tmp_path, name):
    assert_same_as_transformers(write_config(tmp_path, PUBLIC_CONFIGS[name]))


def test_llama3_rope_reaches_the_model_as_transformers_gives_it(tmp_path):
    """The pretraining length that llama3 scaling needs comes from
    max_position_embeddings when the file leaves it out."""
    fields = {"model_type": "llama", **SHORT_LLAMA_LIKE, **VARIANTS["llama3_rope_without_original_length"][1]}
    config = load_hf_config(write_config(tmp_path, fields))
    assert config.rope_parameters["original_max_position_embeddings"] == 256
    assert not hasattr(config, "rope_theta") and not hasattr(config, "rope_scaling")


@pytest.mark.parametrize("contents, message", [
    ("{not json", "cannot read the model's config"),
    ("[1, 2]", "must be a JSON object, got list"),
    (json.dumps({"model_type": "llama", **SHORT_LLAMA_LIKE, "hidden_size": "64"}), "hidden_size must be a positive int"),
    (json.dumps({"model_type": "qwen3", **SHORT_LLAMA_LIKE, "num_hidden_layers": 0}), "num_hidden_layers must be"),
    (json.dumps({"model_type": "opt", **SHORT_OPT, "ffn_dim": True}), "ffn_dim must be a positive int, got True"),
    (json.dumps({"model_type": "mistral", **SHORT_LLAMA_LIKE, "head_dim": -8}), "head_dim must be"),
    (json.dumps({"model_type": "llama", **SHORT_LLAMA_LIKE, "hidden_size": 66}), r"hidden_size \(66\) is not a multiple"),
])
def test_broken_configs_get_a_clear_error(tmp_path, contents, message):
    (tmp_path / "config.json").write_text(contents)
    with pytest.raises(ValueError, match=message):
        ModelConfig(model=str(tmp_path), device="cpu")


def test_other_model_types_are_transformers_configs(tmp_path):
    """A model type without a table here keeps transformers' class, and the
    registry refuses it by name as before."""
    transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4).save_pretrained(tmp_path)
    config = ModelConfig(model=str(tmp_path), device="cpu").hf_config
    assert type(config) is transformers.GPT2Config
    with pytest.raises(ValueError, match="unsupported model architecture"):
        get_model_class(config)


def test_overrides_apply_and_are_checked(tmp_path):
    folder = str(write_config(tmp_path, {"model_type": "qwen2", **SHORT_LLAMA_LIKE}))
    config = ModelConfig(model=folder, hf_overrides={"num_hidden_layers": 1}, device="cpu")
    assert config.hf_config.num_hidden_layers == 1
    with pytest.raises(ValueError, match="num_hidden_layers must be a positive int, got '1'"):
        ModelConfig(model=folder, hf_overrides={"num_hidden_layers": "1"}, device="cpu")


def test_hf_baseline_builds_transformers_model_from_our_config(tmp_path):
    """--hf-baseline with dummy weights hands transformers its own config."""
    folder = write_config(tmp_path, {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **SHORT_LLAMA_LIKE})
    model = load_hf_model(ModelConfig(model=str(folder), load_format="dummy", device="cpu"), torch.device("cpu"))
    assert type(model) is transformers.Qwen3ForCausalLM and model.config.num_hidden_layers == 2


def test_engine_reads_a_folder_without_transformers(tmp_path):
    """The engine on a config.json folder, token ids in and out (what the
    engine core does at start): transformers is never imported."""
    CONFIGS["qwen3"]().save_pretrained(tmp_path)
    script = """
from pagoda import LLM, SamplingParams
llm = LLM(model=PATH, load_format="dummy", skip_tokenizer_init=True, max_model_len=64, kv_cache_space=0.01)
out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
assert len(out[0].outputs[0].token_ids) == 4
"""
    assert imported_modules(script, str(tmp_path), ("transformers",)) == []
