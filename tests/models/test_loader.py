"""get_model: sharded safetensors, dummy weights, errors, and the peak memory
of loading (measured in a subprocess)."""

import json
import os
import subprocess
import sys

import pytest
import torch
import transformers
from checkpoints import build_hf_model, save_checkpoint
from harness import PagedRunner, run_schedule
from safetensors.torch import save_file

from pagoda.model_executor.model_loader import get_model

PROMPTS = [[1, 2, 3, 4, 5, 6], [9, 8, 7]]


def logits_of(model, dtype=torch.float32):
    return run_schedule(PagedRunner(model, dtype), PROMPTS, [len(p) for p in PROMPTS], [1, 1])


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    hf = build_hf_model("qwen2")
    return hf, save_checkpoint(hf, str(tmp_path_factory.mktemp("qwen2")))


def test_sharded_safetensors(qwen2, tmp_path):
    hf, single = qwen2
    sharded = save_checkpoint(hf, str(tmp_path), max_shard_size="40KB")
    with open(os.path.join(sharded, "model.safetensors.index.json")) as f:
        assert len(set(json.load(f)["weight_map"].values())) > 3
    config = transformers.AutoConfig.from_pretrained(sharded)
    got = logits_of(get_model(sharded, config, torch.float32))
    want = logits_of(get_model(single, config, torch.float32))
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_parameters_are_frozen_and_in_dtype(qwen2):
    _, folder = qwen2
    model = get_model(folder, transformers.AutoConfig.from_pretrained(folder), torch.bfloat16)
    assert not model.training
    for name, param in model.named_parameters():
        assert param.dtype == torch.bfloat16 and not param.requires_grad, name


def test_dummy_weights_are_seeded(qwen2):
    config = transformers.AutoConfig.from_pretrained(qwen2[1])
    first, second = (logits_of(get_model("unused", config, torch.float32, load_format="dummy")) for _ in range(2))
    for a, b in zip(first, second):
        assert torch.isfinite(a).all() and torch.equal(a, b)


def test_missing_and_unexpected_weights(qwen2, tmp_path):
    hf, folder = qwen2
    config = transformers.AutoConfig.from_pretrained(folder)
    state = {k: v for k, v in hf.state_dict().items() if k != "model.layers.1.self_attn.k_proj.weight"}
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing .*model.layers.1.self_attn.qkv_proj.weight \(k\)"):
        get_model(str(tmp_path), config, torch.float32)
    state = dict(hf.state_dict(), **{"model.layers.0.mlp.extra.weight": torch.zeros(2)})
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="unexpected weight 'model.layers.0.mlp.extra.weight'"):
        get_model(str(tmp_path), config, torch.float32)


def test_file_errors(qwen2, tmp_path):
    config = transformers.AutoConfig.from_pretrained(qwen2[1])
    with pytest.raises(FileNotFoundError, match="does not exist"):
        get_model(str(tmp_path / "nope"), config, torch.float32)
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"no \*.safetensors weights .* pytorch_model.bin"):
        get_model(str(tmp_path), config, torch.float32)
    with pytest.raises(FileNotFoundError, match="GGUF file"):
        get_model(str(tmp_path), config, torch.float32, gguf_file="model.gguf")
    with pytest.raises(FileNotFoundError, match="pass gguf_file"):
        get_model(str(tmp_path), config, torch.float32, load_format="gguf")
    with pytest.raises(ValueError, match="unknown load_format 'pt'"):
        get_model(str(tmp_path), config, torch.float32, load_format="pt")


# Loads a checkpoint and reports memory: VmRSS before, after, and the peak
# (VmHWM, reset first through /proc/self/clear_refs) in kB.
_MEASURE = """
import json, sys, torch, transformers
from pagoda.model_executor.model_loader import get_model

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))

folder, dtype = sys.argv[1], getattr(torch, sys.argv[2])
config = transformers.AutoConfig.from_pretrained(folder)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets VmHWM to the current RSS
before = status("VmRSS")
model = get_model(folder, config, dtype)
print(json.dumps(dict(before=before, after=status("VmRSS"), peak=status("VmHWM"))))
"""


@pytest.fixture(scope="module")
def big_checkpoint(tmp_path_factory):
    """~200 MB of fp32 weights in 8 layers: like real models, many tensors,
    none more than a few percent of the total."""
    folder = tmp_path_factory.mktemp("big")
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=768, intermediate_size=2048, num_hidden_layers=8,
        num_attention_heads=12, num_key_value_heads=3, architectures=["LlamaForCausalLM"],
    )
    config.save_pretrained(folder)
    with torch.device("meta"):
        shapes = {name: p.shape for name, p in transformers.LlamaForCausalLM(config).state_dict().items()}
    generator = torch.Generator().manual_seed(0)
    tensors = {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}
    save_file(tensors, str(folder / "model.safetensors"))
    return str(folder), sum(s.numel() for s in shapes.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loading_peak_memory(big_checkpoint, dtype):
    """The peak above the starting RSS stays under 1.3x what the loaded
    weights take: the mapped file does not stay resident beside them, and
    the bf16 run casts tensor by tensor."""
    folder, numel = big_checkpoint
    weight_kb = numel * dtype.itemsize / 1024
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    result = subprocess.run(
        [sys.executable, "-c", _MEASURE, folder, str(dtype).removeprefix("torch.")],
        env=env, capture_output=True, text=True, check=True,
    )
    mem = json.loads(result.stdout.strip().splitlines()[-1])
    assert mem["after"] - mem["before"] > 0.9 * weight_kb, mem  # the weights really are resident
    assert mem["peak"] - mem["before"] < 1.3 * weight_kb, (mem, weight_kb)
