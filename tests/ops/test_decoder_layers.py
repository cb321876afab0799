"""llama_decoder_layers (a llama-family model's layers in one CPU op) against
the same layers built from the other ops' pure-torch references, for decode
batches of 1 and 17 sequences, an odd-length prefill and a mixed batch, over
GQA and plain multi-head attention and every GGUF type of the linears."""

import itertools

import pytest
import torch

from pagoda import ops

HIDDEN, INTERMEDIATE, BLOCK_SIZE, EPS = 64, 96, 16, 1e-5


def make_layers(num_layers, num_heads, num_kv_heads, head_size, types, num_blocks):
    """Per-layer weights and caches as ops.llama_decoder_layers takes them;
    the caches hold random values (earlier tokens' keys and values)."""
    weights, weight_types, kv_caches = [], [], []
    for layer in range(num_layers):
        qkv_type, o_type, gate_up_type, down_type = types[layer % len(types)]
        weights += [
            ops.gguf_random_blocks((num_heads + 2 * num_kv_heads) * head_size, HIDDEN, qkv_type),
            ops.gguf_random_blocks(HIDDEN, num_heads * head_size, o_type),
            1 + 0.1 * torch.randn(HIDDEN),
            ops.gguf_random_blocks(2 * INTERMEDIATE, HIDDEN, gate_up_type),
            ops.gguf_random_blocks(HIDDEN, INTERMEDIATE, down_type),
            1 + 0.1 * torch.randn(HIDDEN),
        ]
        weight_types += [qkv_type, o_type, gate_up_type, down_type]
        kv_caches += [torch.randn(num_blocks, BLOCK_SIZE, num_kv_heads, head_size) for _ in range(2)]
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


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("heads", [(4, 2), (3, 3)], ids=["gqa", "mha"])
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
def test_llama_decoder_layers(batch, heads, is_neox):
    torch.manual_seed(0)
    num_heads, num_kv_heads = heads
    head_size, num_layers = 32, 3
    num_blocks, metadata = make_batch(*BATCHES[batch])
    weights, weight_types, kv_caches = make_layers(num_layers, num_heads, num_kv_heads, head_size, TYPES, num_blocks)
    tokens = metadata["positions"].numel()
    hidden, residual = torch.randn(tokens, HIDDEN), torch.randn(tokens, HIDDEN)
    args = dict(
        weights=weights, weight_types=weight_types, cos_sin_cache=ops.rotary_cos_sin_cache(head_size, 128),
        is_neox=is_neox, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
        scale=head_size**-0.5, eps=EPS, **metadata,
    )
    want_hidden, want_residual, want_caches = ops.llama_decoder_layers_reference(
        hidden, residual, kv_caches=kv_caches, **args
    )
    caches = [c.clone() for c in kv_caches]
    ops.llama_decoder_layers(hidden, residual, kv_caches=caches, **args)
    # Three layers of fp32 sums in another order than the references' (fp64
    # linears, fp32 norms and attention), each layer's rounding amplified by
    # the next: within 3e-4 of each tensor's largest value (seen: up to 5.5e-5;
    # a wrong weight, head or slot is off by the values themselves).
    for got, want in [(hidden, want_hidden), (residual, want_residual), *zip(caches, want_caches)]:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=3e-4 * want.abs().max().item())


def test_llama_decoder_layers_errors():
    num_blocks, metadata = make_batch([5], [1])
    weights, weight_types, kv_caches = make_layers(2, 2, 2, 32, TYPES, num_blocks)
    args = dict(cos_sin_cache=ops.rotary_cos_sin_cache(32, 16), is_neox=True, num_heads=2, num_kv_heads=2,
                head_size=32, scale=1.0, eps=EPS, **metadata)
    with pytest.raises(ValueError, match="per layer, weights needs 6 tensors"):
        ops.llama_decoder_layers(torch.randn(1, HIDDEN), torch.randn(1, HIDDEN), weights=weights[:-1],
                                 weight_types=weight_types, kv_caches=kv_caches, **args)
    with pytest.raises(ValueError, match="is outside the cos_sin_cache"):
        bad = dict(args, positions=torch.tensor([99]))
        ops.llama_decoder_layers(torch.randn(1, HIDDEN), torch.randn(1, HIDDEN), weights=weights,
                                 weight_types=weight_types, kv_caches=kv_caches, **bad)
