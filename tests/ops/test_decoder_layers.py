"""llama_decoder_layers (a llama-family model's layers in one CPU op) against
the same layers built from the other ops' pure-torch references, for decode
batches of 1 and 17 sequences, an odd-length prefill and a mixed batch, over
GQA and plain multi-head attention and every GGUF type of the linears."""

import itertools

import pytest
import torch

from pagoda import ops

HIDDEN, INTERMEDIATE, BLOCK_SIZE, EPS = 64, 96, 16, 1e-5


def random_weight(rows, cols, weight_type, dtype):
    """GGUF blocks of weight_type, or a dense matrix of dtype (of about the
    blocks' scale) for ops.DENSE_WEIGHT."""
    if weight_type == ops.DENSE_WEIGHT:
        return (torch.randn(rows, cols) * cols**-0.5).to(dtype)
    return ops.gguf_random_blocks(rows, cols, weight_type)


def make_layers(num_layers, num_heads, num_kv_heads, head_size, types, num_blocks, dtype=torch.float32,
                cache_dtype=None):
    """Per-layer weights and caches (in cache_dtype, default dtype) as
    ops.llama_decoder_layers takes them; the caches hold random values
    (earlier tokens' keys and values)."""
    weights, weight_types, kv_caches = [], [], []
    for layer in range(num_layers):
        qkv_type, o_type, gate_up_type, down_type = types[layer % len(types)]
        weights += [
            random_weight((num_heads + 2 * num_kv_heads) * head_size, HIDDEN, qkv_type, dtype),
            random_weight(HIDDEN, num_heads * head_size, o_type, dtype),
            (1 + 0.1 * torch.randn(HIDDEN)).to(dtype),
            random_weight(2 * INTERMEDIATE, HIDDEN, gate_up_type, dtype),
            random_weight(HIDDEN, INTERMEDIATE, down_type, dtype),
            (1 + 0.1 * torch.randn(HIDDEN)).to(dtype),
        ]
        weight_types += [qkv_type, o_type, gate_up_type, down_type]
        kv_caches += [
            torch.randn(num_blocks, BLOCK_SIZE, num_kv_heads, head_size).to(cache_dtype or dtype) for _ in range(2)
        ]
    return weights, weight_types, kv_caches


def make_batch(seq_lens, q_lens):
    """Block tables over scattered blocks, and each new token's position and
    cache slot (the q_len newest of its sequence)."""
    blocks_needed = [-(-n // BLOCK_SIZE) for n in seq_lens]
    num_blocks = sum(blocks_needed) + 2
    block_ids = torch.randperm(num_blocks).int()
    block_tables = torch.zeros(len(seq_lens), max(blocks_needed) + 1, dtype=torch.int32)
    positions, slots, first = [], [], 0
    for s, (seq_len, q_len) in enumerate(zip(seq_lens, q_lens)):
        block_tables[s, : blocks_needed[s]] = block_ids[first : first + blocks_needed[s]]
        first += blocks_needed[s]
        for p in range(seq_len - q_len, seq_len):
            positions.append(p)
            slots.append(int(block_tables[s, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE)
    return num_blocks, dict(
        positions=torch.tensor(positions),
        slot_mapping=torch.tensor(slots),
        block_tables=block_tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32),
    )


BATCHES = {
    "decode-1": ([40], [1]),
    "decode-17": ([1 + 7 * i for i in range(17)], [1] * 17),
    "prefill-odd": ([13], [13]),
    "mixed": ([50, 17, 33], [1, 17, 5]),
}
TYPES = [(3, 3, 3, 3), (2, 8, 3, 2), (8, 2, 8, 3)]  # Q4_1 throughout (SmolLM2), then mixed Q4_0 / Q8_0
D = ops.DENSE_WEIGHT
# (seen: 6.7e-2 past rtol over 5 seeds; tests/models/test_gguf.py holds the
# op to the per-op path bit for bit)
INT8_TOLERANCE = (1e-3, 0.15)
BF16_TOLERANCE = (1.6e-2, 1e-2)  # rtol, atol as a fraction of the largest value (seen: 3.8e-3 past rtol)
# Dense weights throughout (a bf16 or fp32 checkpoint), and dense beside packed
# (a GGUF file whose fused parts differ in type is dequantized at load).
DENSE_TYPES = {torch.bfloat16: [(D, D, D, D)], torch.float32: [(D, D, D, D), (3, D, 8, D)]}


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("heads", [(4, 2), (3, 3)], ids=["gqa", "mha"])
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
def test_llama_decoder_layers(batch, heads, is_neox):
    check_layers(batch, heads, is_neox, TYPES, torch.float32)


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("heads", [(4, 2), (3, 3)], ids=["gqa", "mha"])
@pytest.mark.parametrize("dtype", DENSE_TYPES, ids=str)
def test_llama_decoder_layers_dense(batch, heads, dtype):
    check_layers(batch, heads, True, DENSE_TYPES[dtype], dtype)


@pytest.mark.parametrize("batch", BATCHES)
def test_llama_decoder_layers_int8_inputs(batch):
    """quantize_input: the Q4_0/Q4_1/Q8_0 linears take inputs rounded to int8
    (the reference rounds them the same way)."""
    check_layers(batch, (4, 2), True, TYPES, torch.float32, quantize_input=True)


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("heads", [(4, 2), (3, 3)], ids=["gqa", "mha"])
def test_llama_decoder_layers_bf16_cache(batch, heads):
    """fp32 activations over a bf16 KV cache (--kv-cache-dtype bfloat16): the
    reference rounds K/V into the cache as torch does."""
    check_layers(batch, heads, True, TYPES, torch.float32, cache_dtype=torch.bfloat16)


def check_layers(batch, heads, is_neox, types, dtype, quantize_input=False, cache_dtype=None):
    torch.manual_seed(0)
    num_heads, num_kv_heads = heads
    head_size, num_layers = 32, 3
    num_blocks, metadata = make_batch(*BATCHES[batch])
    weights, weight_types, kv_caches = make_layers(
        num_layers, num_heads, num_kv_heads, head_size, types, num_blocks, dtype, cache_dtype
    )
    if quantize_input:  # the int8 path's weights are panels, as the loader repacks them
        linears = [i for i in range(len(weights)) if i % 6 not in (2, 5)]
        for i, weight_type in zip(linears, weight_types):
            if weight_type in ops.GGUF_INT8_TYPES:
                weights[i] = ops.gguf_to_panels(weights[i], weight_type)
    tokens = metadata["positions"].numel()
    hidden, residual = torch.randn(tokens, HIDDEN).to(dtype), torch.randn(tokens, HIDDEN).to(dtype)
    args = dict(
        weights=weights, weight_types=weight_types, cos_sin_cache=ops.rotary_cos_sin_cache(head_size, 128),
        is_neox=is_neox, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
        scale=head_size**-0.5, eps=EPS, quantize_input=quantize_input, **metadata,
    )
    want_hidden, want_residual, want_caches = ops.llama_decoder_layers_reference(
        hidden, residual, kv_caches=kv_caches, **args
    )
    caches = [c.clone() for c in kv_caches]
    ops.llama_decoder_layers(hidden, residual, kv_caches=caches, **args)
    # Three layers of fp32 sums in another order than the references' (fp64
    # linears, fp32 norms and attention), each layer's rounding amplified by
    # the next: within 3e-4 of each tensor's largest value (seen: up to 5.5e-5;
    # a wrong weight, head or slot is off by the values themselves). In bf16
    # every op rounds its output to 8 bits, and a sum rounded the other way
    # (2^-9 relative) travels on through the layers: BF16_TOLERANCE.
    # int8 inputs: a sum rounded the other way can move an input across an
    # int8 rounding boundary, off by half a step (1/254 of its block's
    # largest value) in the next layer, and attention's softmax and the
    # next layers amplify it: INT8_TOLERANCE. A bf16 cache: a key or value
    # computed in another order can round to the neighbouring bf16 value.
    rtol, atol = (1e-4, 3e-4) if dtype == torch.float32 and cache_dtype is None else BF16_TOLERANCE
    if quantize_input:
        rtol, atol = INT8_TOLERANCE
    for got, want in [(hidden, want_hidden), (residual, want_residual), *zip(caches, want_caches)]:
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol * want.abs().max().item())


def test_llama_decoder_layers_errors():
    num_blocks, metadata = make_batch([5], [1])
    weights, weight_types, kv_caches = make_layers(2, 2, 2, 32, TYPES, num_blocks)
    args = dict(cos_sin_cache=ops.rotary_cos_sin_cache(32, 16), is_neox=True, num_heads=2, num_kv_heads=2,
                head_size=32, scale=1.0, eps=EPS, **metadata)
    with pytest.raises(ValueError, match="per layer, weights needs 6 tensors"):
        ops.llama_decoder_layers(torch.randn(1, HIDDEN), torch.randn(1, HIDDEN), weights=weights[:-1],
                                 weight_types=weight_types, kv_caches=kv_caches, **args)
    with pytest.raises(TypeError, match="input must be float32"):  # packed weights take fp32 activations
        bf16 = [w.bfloat16() if w.is_floating_point() else w for w in weights]
        ops.llama_decoder_layers(torch.randn(1, HIDDEN).bfloat16(), torch.randn(1, HIDDEN).bfloat16(), weights=bf16,
                                 weight_types=weight_types, kv_caches=[c.bfloat16() for c in kv_caches], **args)
    with pytest.raises(ValueError, match="is outside the cos_sin_cache"):
        bad = dict(args, positions=torch.tensor([99]))
        ops.llama_decoder_layers(torch.randn(1, HIDDEN), torch.randn(1, HIDDEN), weights=weights,
                                 weight_types=weight_types, kv_caches=kv_caches, **bad)
