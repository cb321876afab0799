"""paged_attention (prefill, chunked prefill, prefix-cache hits and decode in
one call) against the pure-torch reference."""

import itertools
import math

import pytest
import torch

from op_testing import skip_without_kernel

from pagoda import _native, ops

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Outputs are weighted means of values ~ N(0, 1): some are near zero, so an
# absolute tolerance of about one unit in the last place at 1.0 as well.
TOLERANCES = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),
    torch.float16: dict(rtol=2.5e-3, atol=1e-3),
}
# GQA ratios 1 (MHA), 2, 3, 4 and 8.
HEADS = [(8, 8), (8, 4), (9, 3), (8, 2), (8, 1)]
# Block table entries past a sequence's last block: never read (a kernel that
# did would fault).
UNUSED_BLOCK = 1 << 30


@pytest.fixture
def device(device):
    return skip_without_kernel("paged_attention", device)


def make_batch(
    seq_lens,
    q_lens,
    num_heads,
    num_kv_heads,
    head_size,
    block_size=16,
    dtype=torch.float32,
    device="cpu",
    fused_qkv=False,
    spare_blocks=3,
    table_columns=None,
):
    """A random cache whose blocks are scattered over the sequences, and the
    queries of each sequence's q_len newest tokens. block_tables has one
    column more than the longest sequence needs, or table_columns (padded as
    the model runner pads them for CUDA graphs: max_model_len / block_size)."""
    blocks_needed = [-(-seq_len // block_size) for seq_len in seq_lens]
    num_blocks = sum(blocks_needed) + spare_blocks
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_size, dtype=dtype, device=device)
    value_cache = torch.randn_like(key_cache)
    block_ids = torch.randperm(num_blocks).int()
    columns = max(blocks_needed, default=0) + 1 if table_columns is None else table_columns
    block_tables = torch.full((len(seq_lens), columns), UNUSED_BLOCK, dtype=torch.int32)
    first = 0
    for s, n in enumerate(blocks_needed):
        block_tables[s, :n] = block_ids[first : first + n]
        first += n
    num_tokens = sum(q_lens)
    if fused_qkv:
        qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_size, dtype=dtype, device=device)
        query = qkv[:, : num_heads * head_size].unflatten(-1, (num_heads, head_size))
    else:
        query = torch.randn(num_tokens, num_heads, head_size, dtype=dtype, device=device)
    return dict(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=block_tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device=device),
        scale=1.0 / math.sqrt(head_size),
    )


def check(batch, out=None):
    if out is None:  # poisoned: every element must be written
        out = torch.full(batch["query"].shape, float("nan"), dtype=batch["query"].dtype, device=batch["query"].device)
    got = ops.paged_attention(**batch, out=out)
    want = ops.paged_attention_reference(**batch, compute_dtype=torch.float64)
    torch.testing.assert_close(got, want, **TOLERANCES[batch["query"].dtype])
    return got


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("head_size", [64, 128, 256])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode(device, dtype, heads, head_size, block_size):
    seq_lens = [1, 15, 16, 17, 32, 33, 100, 1000]
    check(make_batch(seq_lens, [1] * len(seq_lens), *heads, head_size, block_size, dtype, device))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("block_size", [16, 32])
def test_prefill(device, dtype, heads, block_size):
    seq_lens = [1, 15, 16, 17, 32, 33, 70]
    check(make_batch(seq_lens, seq_lens, *heads, 64, block_size, dtype, device))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("fused_qkv", [False, True])
def test_mixed_batch(device, dtype, heads, block_size, fused_qkv):
    # prefill, chunked prefill (70 cached + 30 new), decode, a first token,
    # a prefix-cache hit (16 cached + 17 new), a sequence with no new tokens
    # this step, and a decode on a block boundary.
    seq_lens = [40, 100, 17, 1, 33, 64, 32]
    q_lens = [40, 30, 1, 1, 17, 0, 1]
    check(make_batch(seq_lens, q_lens, *heads, 64, block_size, dtype, device, fused_qkv=fused_qkv))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", [64, 80, 96, 128, 256, 8, 24, 40, 72, 36])
def test_head_sizes(device, dtype, head_size):
    check(make_batch([33, 5, 70], [1, 5, 20], 4, 2, head_size, 16, dtype, device))


@pytest.mark.parametrize("block_size", [1, 5, 8, 64, 128])
def test_other_block_sizes(device, block_size):
    check(make_batch([1, 17, 130, 64], [1, 17, 9, 1], 9, 3, 64, block_size, torch.float32, device))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
def test_long_sequences(device, dtype, block_size):
    # A long decode, a long chunked prefill and a long full prefill.
    check(make_batch([1500, 1100, 1025], [1, 200, 1025], 8, 2, 128, block_size, dtype, device))


def test_one_token(device):
    check(make_batch([1], [1], 4, 1, 64, 16, torch.float32, device))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", [64, 128, 256])
def test_long_contexts(device, dtype, head_size):
    """Contexts of thousands of tokens: the GPU splits each into partitions
    (split-K) and merges them; beside short sequences that fit one."""
    check(make_batch([5000, 6100, 300, 1], [1, 4, 1, 1], 8, 2, head_size, 16, dtype, device))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [16, 32])
def test_partition_boundaries(device, dtype, block_size):
    """Contexts ending just before, on and after multiples of the GPU's key
    partitions (256 keys here) and of its 16-key steps."""
    seq_lens = [15, 16, 17, 255, 256, 257, 511, 512, 513, 1023, 1024, 1025]
    check(make_batch(seq_lens, [1] * len(seq_lens), 8, 2, 128, block_size, dtype, device))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("columns", [256, 2048])
def test_padded_block_tables(device, dtype, columns):
    """Block tables padded far past the longest sequence (max_model_len /
    block_size columns, as for CUDA graphs): the extra columns are never
    read, and the GPU's partitions past a sequence's end do nothing."""
    seq_lens = [1, 100, 1000, 2100, 37]
    check(make_batch(seq_lens, [1, 1, 1, 3, 37], 16, 4, 128, 16, dtype, device, table_columns=columns))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(32, 2), (36, 2), (12, 1)])
def test_large_gqa_groups(device, dtype, heads):
    """GQA groups of more than 8 query heads (16, 18, 12): the GPU serves
    them in slices of at most 8 heads."""
    check(make_batch([700, 33, 1], [1, 33, 1], *heads, 128, 16, dtype, device))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_large_mixed_batch(device, dtype):
    """A step as the scheduler forms it: 24 decodes of assorted lengths, a
    chunked prefill and a fresh prompt."""
    generator = torch.Generator().manual_seed(1)
    decodes = torch.randint(1, 2000, (24,), generator=generator).tolist()
    seq_lens = decodes[:12] + [900] + decodes[12:] + [130]
    q_lens = [1] * 12 + [256] + [1] * 12 + [130]
    check(make_batch(seq_lens, q_lens, 16, 4, 128, 16, dtype, device, table_columns=200))


@pytest.mark.parametrize("seq_lens,q_lens", [([], []), ([5, 16], [0, 0])])
def test_no_tokens(device, seq_lens, q_lens):
    batch = make_batch(seq_lens, q_lens, 4, 2, 64, 16, torch.bfloat16, device)
    out = ops.paged_attention(**batch)
    assert out.shape == (0, 4, 64)


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_query_and_out(device, dtype):
    batch = make_batch([20, 50], [20, 1], 9, 3, 64, 16, dtype, device, fused_qkv=True)
    assert not batch["query"].is_contiguous()
    buffer = torch.randn(21, 9 * 64 + 7, dtype=dtype, device=device)
    before = buffer.clone()
    out = buffer[:, : 9 * 64].unflatten(-1, (9, 64))
    check(batch, out=out)
    assert torch.equal(buffer[:, 9 * 64 :], before[:, 9 * 64 :])


def test_large_scores_are_stable(device):
    batch = make_batch([300, 40], [3, 40], 4, 2, 64, 16, torch.float32, device)
    batch["query"] = batch["query"] * 30  # scores of a few hundred: exp overflows without the running max
    batch["scale"] = 1.0
    out = ops.paged_attention(**batch)
    assert torch.isfinite(out).all()
    # An fp32 score of ~300 is only good to ~2e-5, which the softmax weights inherit.
    want = ops.paged_attention_reference(**batch, compute_dtype=torch.float64)
    torch.testing.assert_close(out, want, rtol=1e-3, atol=1e-4)


def test_gqa_heads_read_their_kv_head(device):
    """Query head h attends with kv head h // group: give every kv head
    constant values and equal attention weights; each output is its constant."""
    batch = make_batch([40], [1], 6, 3, 64, 16, torch.float32, device)
    batch["query"].zero_()
    for h in range(3):
        batch["value_cache"][:, :, h, :] = float(h + 1)
    out = ops.paged_attention(**batch)
    want = torch.tensor([1.0, 1.0, 2.0, 2.0, 3.0, 3.0], device=device)[:, None].expand(6, 64)
    torch.testing.assert_close(out[0], want)


def relocate(batch, num_blocks, seed):
    """The same logical cache contents under other block ids."""
    block_size = batch["key_cache"].shape[1]
    used = [-(-n // block_size) for n in batch["seq_lens"].tolist()]
    new_ids = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))[: sum(used)].int()
    key_cache = torch.randn(num_blocks, *batch["key_cache"].shape[1:], dtype=batch["key_cache"].dtype)
    value_cache = torch.randn_like(key_cache)
    block_tables = torch.full_like(batch["block_tables"], UNUSED_BLOCK)
    first = 0
    for s, n in enumerate(used):
        old = batch["block_tables"][s, :n].long()
        new = new_ids[first : first + n]
        key_cache[new.long()] = batch["key_cache"][old]
        value_cache[new.long()] = batch["value_cache"][old]
        block_tables[s, :n] = new
        first += n
    return dict(batch, key_cache=key_cache, value_cache=value_cache, block_tables=block_tables)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("threads", [1, 2])
def test_block_ids_do_not_matter(dtype, threads):
    """Which physical blocks hold a sequence changes nothing, bit for bit."""
    batch = make_batch([1200, 100, 33, 17], [1, 60, 33, 1], 8, 2, 64, 16, dtype)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        want = ops.paged_attention(**batch)
        for seed, num_blocks in [(1, 100), (2, 200)]:
            got = ops.paged_attention(**relocate(batch, num_blocks, seed))
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("threads", [2, 3, 8])
@pytest.mark.parametrize(
    "seq_lens,q_lens",
    [
        ([4000, 20], [1, 1]),  # one long decode beside a short one
        ([2000, 30], [8, 30]),  # a long chunked prefill beside a short prefill
        ([3000, 2000, 20], [1, 40, 1]),
    ],
)
def test_work_split_over_threads(dtype, threads, seq_lens, q_lens):
    """With several threads, the keys of work items much larger than a
    thread's share are split into ranges whose partial results are merged:
    results match the reference and one thread."""
    batch = make_batch(seq_lens, q_lens, 8, 2, 64, 16, dtype)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        split = check(batch)
        torch.set_num_threads(1)
        torch.testing.assert_close(split, ops.paged_attention(**batch), **TOLERANCES[dtype])
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("heads", [(9, 3), (8, 2), (8, 8)])
@pytest.mark.parametrize("head_size", [64, 40])
def test_items_of_all_kv_heads(dtype, threads, heads, head_size):
    """With chunks enough for every thread, an item takes all kv heads of its
    chunk (head after head within each key tile), while the keys of a long
    sequence beside them are still split into one-head ranges: 17 decodes of
    odd lengths, a 37-token prefill and a 3000-key decode, read in place
    (head size 64) or through converted tiles (40)."""
    seq_lens, q_lens = [3000, 37, *(5 + 11 * i for i in range(17))], [1, 37, *[1] * 17]
    batch = make_batch(seq_lens, q_lens, *heads, head_size, 16, dtype)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        check(batch)
    finally:
        torch.set_num_threads(previous)


def test_engine_steps_match_causal_attention(device):
    """The engine's flow: reshape_and_cache the new tokens' K/V, then
    paged_attention; a chunked prefill then decode steps, compared with plain
    causal attention over each sequence's whole history."""
    num_heads, num_kv_heads, head_size, block_size = 6, 2, 64, 16
    group = num_heads // num_kv_heads
    lengths = [33, 20]  # prompt lengths
    block_tables = torch.tensor([[4, 9, 1, 7], [0, 5, 8, 2]], dtype=torch.int32, device=device)
    key_cache = torch.zeros(10, block_size, num_kv_heads, head_size, device=device)
    value_cache = torch.zeros_like(key_cache)
    history = [dict(q=[], k=[], v=[]) for _ in lengths]
    scale = 1 / math.sqrt(head_size)

    def step(new_tokens):  # new tokens per sequence
        done = [len(h["k"]) for h in history]
        qs, ks, vs, slots = [], [], [], []
        for s, n in enumerate(new_tokens):
            q, k, v = (torch.randn(n, h, head_size, device=device) for h in (num_heads, num_kv_heads, num_kv_heads))
            history[s]["q"] += list(q)
            history[s]["k"] += list(k)
            history[s]["v"] += list(v)
            positions = torch.arange(done[s], done[s] + n, device=device)
            slots.append(block_tables[s, positions // block_size].long() * block_size + positions % block_size)
            qs.append(q)
            ks.append(k)
            vs.append(v)
        ops.reshape_and_cache(torch.cat(ks), torch.cat(vs), key_cache, value_cache, torch.cat(slots))
        seq_lens = torch.tensor([d + n for d, n in zip(done, new_tokens)], dtype=torch.int32, device=device)
        query_start_loc = torch.tensor([0, new_tokens[0], sum(new_tokens)], dtype=torch.int32, device=device)
        out = ops.paged_attention(torch.cat(qs), key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale)
        first = 0
        for s, n in enumerate(new_tokens):
            q = torch.stack(history[s]["q"]).transpose(0, 1)  # [heads, tokens, head_size]
            k = torch.stack(history[s]["k"]).repeat_interleave(group, dim=1).transpose(0, 1)
            v = torch.stack(history[s]["v"]).repeat_interleave(group, dim=1).transpose(0, 1)
            want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
            torch.testing.assert_close(out[first : first + n], want.transpose(0, 1)[-n:], rtol=1e-5, atol=1e-5)
            first += n

    step([20, 20])  # the first prompt chunked: 20 of its 33 tokens
    step([13, 1])  # the rest of it, and the second sequence's first decode
    for _ in range(3):
        step([1, 1])


@pytest.mark.skipif(
    not (torch.cuda.is_available() and _native.has_cuda_ops()), reason="needs a GPU and Pagoda's CUDA ops"
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_graph_replays_with_new_metadata(dtype):
    """The CUDA op never syncs with the host (capture would fail) and plans its
    launch from shapes alone: one captured graph, replayed with other seq_lens,
    block_tables, query_start_loc and query contents, matches the reference
    each time."""
    device, num_seqs, num_tokens, columns, block_size = "cuda", 8, 16, 128, 16  # contexts up to 2048
    num_heads, num_kv_heads, head_size = 16, 4, 128
    num_blocks = num_seqs * columns
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_size, dtype=dtype, device=device)
    value_cache = torch.randn_like(key_cache)
    static = dict(
        query=torch.empty(num_tokens, num_heads, head_size, dtype=dtype, device=device),
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=torch.empty(num_seqs, columns, dtype=torch.int32, device=device),
        seq_lens=torch.empty(num_seqs, dtype=torch.int32, device=device),
        query_start_loc=torch.empty(num_seqs + 1, dtype=torch.int32, device=device),
        scale=1 / math.sqrt(head_size),
    )
    out = torch.empty(num_tokens, num_heads, head_size, dtype=dtype, device=device)

    def fill(seed, q_lens):
        generator = torch.Generator().manual_seed(seed)
        seq_lens = [q + int(torch.randint(0, columns * block_size - q, (1,), generator=generator)) for q in q_lens]
        ids = torch.randperm(num_blocks, generator=generator).int()
        tables = torch.full((num_seqs, columns), UNUSED_BLOCK, dtype=torch.int32)
        for s, n in enumerate(seq_lens):
            used = -(-n // block_size)
            tables[s, :used] = ids[s * columns : s * columns + used]
        static["block_tables"].copy_(tables)
        static["seq_lens"].copy_(torch.tensor(seq_lens, dtype=torch.int32))
        static["query_start_loc"].copy_(torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32))
        static["query"].copy_(torch.randn(num_tokens, num_heads, head_size, generator=generator))

    fill(0, [2] * num_seqs)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the graph, as torch advises
        ops.paged_attention(**static, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.paged_attention(**static, out=out)
    # Decode-only steps, prefill-heavy ones, and sequences without new tokens.
    steps = [[2] * 8, [1, 1, 1, 1, 1, 1, 1, 9], [0, 16, 0, 0, 0, 0, 0, 0], [3, 1, 2, 4, 1, 1, 2, 2]]
    for seed, q_lens in enumerate(steps, start=1):
        fill(seed, q_lens)
        out.fill_(float("nan"))
        graph.replay()
        want = ops.paged_attention_reference(**static, compute_dtype=torch.float64)
        torch.testing.assert_close(out, want, **TOLERANCES[dtype])


# --- errors (CPU: the metadata values are checked on the host) --------------


def error_batch(**changes):
    batch = make_batch([20, 5], [3, 5], 4, 2, 64, 16)
    batch.update(changes)
    return batch


def op_args(batch, out):
    """The arguments of torch.ops.pagoda.paged_attention, in schema order."""
    keys = ("query", "key_cache", "value_cache", "block_tables", "seq_lens", "query_start_loc", "scale")
    return (out,) + tuple(batch[k] for k in keys)


def call(batch, out=None):
    out = torch.empty(batch["query"].shape, dtype=batch["query"].dtype) if out is None else out
    torch.ops.pagoda.paged_attention(*op_args(batch, out))


def i32(*values):
    return torch.tensor(values, dtype=torch.int32)


@pytest.mark.parametrize(
    "changes,error,message",
    [
        # dtypes
        (dict(query=torch.ones(8, 4, 64, dtype=torch.int32)), TypeError, "query must be float32, bfloat16 or float16"),
        (dict(query=torch.randn(8, 4, 64, dtype=torch.bfloat16)), TypeError, "key_cache has dtype"),
        (dict(key_cache=torch.randn(6, 16, 2, 64, dtype=torch.float16)), TypeError, "key_cache has dtype"),
        (dict(block_tables=torch.zeros(2, 3, dtype=torch.int64)), TypeError, "block_tables must be int32"),
        (dict(seq_lens=torch.tensor([20, 5])), TypeError, "seq_lens must be int32"),
        (dict(query_start_loc=torch.tensor([0, 3, 8])), TypeError, "query_start_loc must be int32"),
        # shapes
        (dict(query=torch.randn(8, 3, 64)), ValueError, "query's 3 heads must be a positive multiple of the cache's 2"),
        (dict(query=torch.randn(8, 4, 32)), ValueError, "key_cache's head size is 64 but query's is 32"),
        (dict(query=torch.randn(8, 256)), ValueError, r"query must be \[num_tokens, num_heads, head_size\]"),
        (dict(query=torch.randn(8, 64, 4).transpose(1, 2)), ValueError, "contiguous in its last two dimensions"),
        (dict(key_cache=torch.randn(6, 16, 64, 2).transpose(2, 3)), ValueError, "key_cache must be contiguous"),
        (dict(key_cache=torch.randn(6, 16, 128)), ValueError, r"key_cache must be \[num_blocks, block_size"),
        (dict(value_cache=torch.randn(7, 16, 2, 64)), ValueError, "value_cache has shape"),
        (dict(seq_lens=i32(20, 5, 1)), ValueError, r"query_start_loc must be a 1-D tensor of num_seqs \+ 1 = 4"),
        (dict(query_start_loc=i32(0, 8)), ValueError, r"num_seqs \+ 1 = 3"),
        (dict(block_tables=torch.zeros(3, 3, dtype=torch.int32)), ValueError, r"block_tables must be \[num_seqs=2"),
        # values (the batch: seq_lens 20 and 5, 3 and 5 new tokens, 6 blocks of 16)
        (dict(seq_lens=i32(20, 4)), ValueError, r"sequence 1 has 5 query tokens but seq_lens\[1\] = 4"),
        (dict(seq_lens=i32(-1, 5)), ValueError, r"seq_lens\[0\] = -1"),
        (dict(seq_lens=i32(49, 5)), ValueError, "0 has 49 tokens in 4 blocks of 16 but block_tables has only 3 "),
        (dict(block_tables=i32([0, 6, 9], [2, 9, 9])), ValueError, r"block_tables\[0, 1\] = 6 is outside"),
        (dict(block_tables=i32([0, 1, 9], [-1, 9, 9])), ValueError, r"block_tables\[1, 0\] = -1 is outside"),
        (dict(query_start_loc=i32(0, 3, 7)), ValueError, r"query_start_loc\[2\] = 7 but query has 8 tokens"),
        (dict(query_start_loc=i32(0, 9, 8)), ValueError, "must not decrease"),
        (dict(query_start_loc=i32(1, 3, 8)), ValueError, r"query_start_loc\[0\] must be 0"),
    ],
)
def test_bad_arguments(changes, error, message):
    with pytest.raises(error, match=message):
        call(error_batch(**changes))


def test_out_shape_mismatch():
    batch = error_batch()
    with pytest.raises(ValueError, match="out has shape"):
        call(batch, out=torch.empty(8, 4, 32))


def test_out_dtype_mismatch():
    batch = error_batch()
    with pytest.raises(TypeError, match="out has dtype"):
        call(batch, out=torch.empty(8, 4, 64, dtype=torch.float16))


def test_meta_tensors_trace_without_computing():
    batch = make_batch([20, 5], [3, 5], 4, 2, 64, 16, device="meta")
    assert ops.paged_attention(**batch).shape == (8, 4, 64)


def test_opcheck():
    batch = make_batch([40, 5, 17], [3, 5, 1], 6, 2, 64, 16)
    out = torch.empty(batch["query"].shape)
    torch.library.opcheck(torch.ops.pagoda.paged_attention.default, op_args(batch, out))


def test_attention_layer_writes_into_out_and_yields_to_a_split(device):
    """Attention.attend(out=...) writes its result there (piecewise CUDA
    graphs read it at a fixed address), equal to a plain call; under
    split_attention the layer hands its inputs to the hook and returns what
    the hook returns."""
    from pagoda.forward_context import AttentionMetadata, set_forward_context, split_attention
    from pagoda.model_executor.layers.attention import Attention

    num_heads, num_kv_heads, head_size = 6, 2, 64
    seq_lens, q_lens = [20, 5, 9], [1, 5, 9]
    batch = make_batch(seq_lens, q_lens, num_heads, num_kv_heads, head_size, device=device)
    num_tokens, tables = sum(q_lens), batch["block_tables"]
    positions = torch.cat([torch.arange(s - q, s) for s, q in zip(seq_lens, q_lens)]).to(device)
    rows = torch.cat([torch.full((q,), i) for i, q in enumerate(q_lens)]).to(device)
    slots = tables[rows, positions // 16].long() * 16 + positions % 16
    metadata = AttentionMetadata(slots, tables, batch["seq_lens"], batch["query_start_loc"], max(q_lens), max(seq_lens))
    layer = Attention(num_heads, head_size, batch["scale"], num_kv_heads)
    layer.kv_cache = (batch["key_cache"], batch["value_cache"])
    q = batch["query"].flatten(1)
    k, v = (torch.randn(num_tokens, num_kv_heads * head_size, device=device) for _ in range(2))
    with set_forward_context(metadata):
        want = layer(q, k, v)
        out = torch.full_like(want, float("nan"))
        got = layer.attend(q, k, v, out=out)
        assert got.data_ptr() == out.data_ptr()
        torch.testing.assert_close(out, want, rtol=0, atol=0)
        seen = []
        with split_attention(lambda *args: seen.append(args) or "split"):
            assert layer(q, k, v) == "split"
    assert seen[0] == (layer, q, k, v)
