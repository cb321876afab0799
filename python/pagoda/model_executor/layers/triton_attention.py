"""Prefill/extend attention over the paged KV cache, in Triton (GPU).

Computes exactly what ops.paged_attention computes (see its docstring): the new
tokens of each sequence attend causally to its cached prefix and to
themselves, K/V read through block_tables from key_cache/value_cache
[num_blocks, block_size, num_kv_heads, head_size]; GQA; fp32/bf16/fp16.

A flash-attention kernel: each program takes BLOCK_M new tokens of one
sequence for one query head, walks that sequence's keys BLOCK_N at a time
(gathered from the cache blocks), and keeps an online softmax (running max and
sum) and the output accumulator in fp32 registers; QK^T and PV are tl.dot, so
they run on the tensor cores (wgmma on Hopper). Keys wholly before the tile's
first query position need no mask; only the diagonal tiles are masked.

Why Triton for this part: prefill is matrix-bound, and what makes it fast is
tensor-core tiling, operand staging through shared memory and software
pipelining, which Triton generates per GPU (wgmma on sm_90, mma.sync on sm_80,
MFMA on AMD) from one short kernel. Decode (one query row per sequence) is
memory-bound and stays a hand-written CUDA kernel (ops.paged_attention).

The grid covers sequences x query tiles x heads, sized from Python ints (the
attention metadata's max_query_len and the number of sequences), so nothing
here reads the GPU's metadata on the host.
"""

from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl

_LOG2_E = 1.4426950408889634
# Triton's interpreter (TRITON_INTERPRET=1, used to test this kernel without a
# GPU) multiplies bfloat16 bit patterns in tl.dot (triton-lang/triton#11584):
# there, bf16 operands are widened to fp32 first. The products are the same (a
# bf16 x bf16 product is exact in fp32), only the summation order may differ.
_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _dot(a, b, WIDEN: tl.constexpr, PRECISION: tl.constexpr):
    if WIDEN:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PRECISION)
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _attend_tile(
    acc,
    m_i,
    l_i,
    q,
    qk_scale,
    start,
    q_pos,
    seq_len,
    block_table,
    k_cache,
    v_cache,
    cache_offset,  # kv head offset inside a cache token
    stride_block,
    stride_token,
    offs_d,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    WIDEN: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One BLOCK_N tile of keys: scores, online-softmax update, PV."""
    offs_n = start + tl.arange(0, BLOCK_N)
    if MASKED:
        n_valid = offs_n < seq_len
        blocks = tl.load(block_table + offs_n // BLOCK_SIZE, mask=n_valid, other=0)
    else:
        blocks = tl.load(block_table + offs_n // BLOCK_SIZE)
    rows = blocks.to(tl.int64) * stride_block + (offs_n % BLOCK_SIZE) * stride_token + cache_offset
    k_ptrs = k_cache + rows[None, :] + offs_d[:, None]  # [HEAD_PAD, BLOCK_N]
    v_ptrs = v_cache + rows[:, None] + offs_d[None, :]  # [BLOCK_N, HEAD_PAD]
    if MASKED:
        if HEAD_PAD == HEAD_SIZE:
            k = tl.load(k_ptrs, mask=n_valid[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=n_valid[:, None], other=0.0)
        else:
            d_valid = offs_d < HEAD_SIZE
            k = tl.load(k_ptrs, mask=d_valid[:, None] & n_valid[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=n_valid[:, None] & d_valid[None, :], other=0.0)
    else:
        if HEAD_PAD == HEAD_SIZE:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        else:
            d_valid = offs_d < HEAD_SIZE
            k = tl.load(k_ptrs, mask=d_valid[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=d_valid[None, :], other=0.0)

    # A float8 cache is widened to the query's dtype (exactly); else a no-op.
    k = k.to(q.dtype)
    v = v.to(q.dtype)
    s = _dot(q, k, WIDEN, PRECISION) * qk_scale  # fp32 scores, in base 2
    if MASKED:
        visible = (offs_n[None, :] <= q_pos[:, None]) & n_valid[None, :]
        s = tl.where(visible, s, float("-inf"))
    # Every row sees at least one key in the first tile it processes (see the
    # caller), so m_new is finite and no exp2(-inf - -inf) NaN can arise.
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    # P is rounded to the cache dtype for the tensor cores, as in FlashAttention.
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, WIDEN, PRECISION)
    return acc, m_new, l_i


# Triton compiles a variant per value class of each int argument (== 1,
# divisible by 16, other). These two change from step to step (the batch's
# widest block table, its longest new-token run) and only feed index math: one
# variant serves all, so no compile lands in the middle of serving.
@triton.jit(do_not_specialize=["stride_table", "tiles_per_seq"])
def _paged_prefill_kernel(
    out,
    query,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    query_start_loc,
    qk_scale,  # scale * log2(e): the softmax runs in base 2
    stride_q_token,
    stride_q_head,
    stride_o_token,
    stride_o_head,
    stride_block,
    stride_token,
    stride_kv_head,
    stride_table,
    num_heads,
    tiles_per_seq,
    GROUP: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WIDEN: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # One flat grid axis (the y/z axes stop at 65535), heads fastest: the
    # query heads that share a kv head run side by side and share its K/V
    # tiles in L2. Within a sequence the last query tile, which sees the
    # most keys, starts first.
    pid = tl.program_id(0)
    head = pid % num_heads
    seq = pid // num_heads // tiles_per_seq
    tile_start = (tiles_per_seq - 1 - pid // num_heads % tiles_per_seq) * BLOCK_M
    q_begin = tl.load(query_start_loc + seq)
    q_len = tl.load(query_start_loc + seq + 1) - q_begin
    if tile_start >= q_len:  # the grid covers max_query_len; this sequence is shorter
        return
    seq_len = tl.load(seq_lens + seq)
    context_len = seq_len - q_len

    offs_m = tile_start + tl.arange(0, BLOCK_M)  # new-token index within the sequence
    offs_d = tl.arange(0, HEAD_PAD)
    m_valid = offs_m < q_len
    d_valid = offs_d < HEAD_SIZE
    tokens = (q_begin + offs_m).to(tl.int64)
    q = tl.load(
        query + tokens[:, None] * stride_q_token + head * stride_q_head + offs_d[None, :],
        mask=m_valid[:, None] & d_valid[None, :],
        other=0.0,
    )
    q_pos = context_len + offs_m

    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    block_table = block_tables + seq.to(tl.int64) * stride_table
    cache_offset = (head // GROUP).to(tl.int64) * stride_kv_head

    first_pos = context_len + tile_start
    # Keys in [0, unmasked_end) precede every query of the tile: no mask.
    unmasked_end = (first_pos // BLOCK_N) * BLOCK_N
    # The last query of the tile sees keys up to its own position.
    kv_end = tl.minimum(first_pos + BLOCK_M, seq_len)
    for start in range(0, unmasked_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, qk_scale, start, q_pos, seq_len, block_table, k_cache, v_cache, cache_offset,
            stride_block, stride_token, offs_d, HEAD_SIZE, HEAD_PAD, BLOCK_SIZE, BLOCK_N, False, WIDEN, PRECISION,
        )  # fmt: skip
    # The first masked tile starts at or before first_pos < seq_len: every row,
    # padding rows (position >= seq_len) included, sees its first key.
    for start in range(unmasked_end, kv_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, qk_scale, start, q_pos, seq_len, block_table, k_cache, v_cache, cache_offset,
            stride_block, stride_token, offs_d, HEAD_SIZE, HEAD_PAD, BLOCK_SIZE, BLOCK_N, True, WIDEN, PRECISION,
        )  # fmt: skip

    acc = acc / l_i[:, None]
    tl.store(
        out + tokens[:, None] * stride_o_token + head * stride_o_head + offs_d[None, :],
        acc.to(out.dtype.element_ty),
        mask=m_valid[:, None] & d_valid[None, :],
    )


def _tile_config(head_pad: int, max_query_len: int, dtype: torch.dtype) -> dict:
    """Tile sizes: a query tile no taller than the longest new-token run (a
    short extend does not compute 128 rows of padding), and K/V tiles that
    keep Q, the accumulator and the pipelined K/V stages within the register
    file and shared memory."""
    wide = head_pad > 128 or dtype == torch.float32
    block_m = min(max(16, triton.next_power_of_2(max_query_len)), 64 if wide else 128)
    block_n = 32 if wide else 64
    return dict(
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=8 if block_m * head_pad >= 128 * 128 else 4,
        num_stages=2 if wide else 3,
    )


def _head_pad(head_size: int) -> int:
    """tl.dot needs every dimension >= 16; padded head lanes are masked."""
    return max(16, triton.next_power_of_2(head_size))


def variant_query_lens(head_size: int, dtype: torch.dtype, max_query_len: int) -> list[int]:
    """One longest new-token run per tile variant that steps of up to
    max_query_len new tokens per sequence use (runs of 2 and up: a step of
    single tokens goes to the decode kernel). A step with each of these runs
    compiles every variant that serving can meet, so a warm-up made of them
    leaves no JIT compile for the middle of serving."""
    head_pad = _head_pad(head_size)
    lens, seen, bound = [], set(), 2
    while bound < 2 * max_query_len:  # the tile height changes only at powers of two
        n = min(bound, max_query_len)
        config = tuple(sorted(_tile_config(head_pad, n, dtype).items()))
        if config not in seen:
            seen.add(config)
            lens.append(n)
        bound *= 2
    return lens


def _check(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, out) -> None:
    if query.dim() != 3 or query.stride(2) != 1:
        raise ValueError(f"query must be [num_tokens, num_heads, head_size] with a contiguous last dimension, "
                         f"got shape {tuple(query.shape)}, strides {query.stride()}")
    if query.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"query must be float32, bfloat16 or float16, got {query.dtype}")
    fp8_cache = key_cache.dtype == torch.float8_e4m3fn and query.dtype != torch.float32
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache), ("out", out)):
        if t.dtype != query.dtype and not (fp8_cache and t is not out and t.dtype == torch.float8_e4m3fn):
            raise TypeError(f"{name} has dtype {t.dtype} but query has {query.dtype}; they must match")
        if t.device != query.device:
            raise ValueError(f"{name} is on {t.device} but query is on {query.device}; all must be on one device")
    if out.shape != query.shape or out.stride(2) != 1:
        raise ValueError(f"out must have query's shape {tuple(query.shape)} and a contiguous last dimension, "
                         f"got shape {tuple(out.shape)}, strides {out.stride()}")
    if key_cache.dim() != 4 or not key_cache.is_contiguous():
        raise ValueError(f"key_cache must be a contiguous [num_blocks, block_size, num_kv_heads, head_size] tensor, "
                         f"got shape {tuple(key_cache.shape)}")
    if value_cache.shape != key_cache.shape or not value_cache.is_contiguous():
        raise ValueError(f"value_cache must be contiguous with key_cache's shape {tuple(key_cache.shape)}, "
                         f"got {tuple(value_cache.shape)}")
    if key_cache.shape[3] != query.shape[2]:
        raise ValueError(f"key_cache's head size is {key_cache.shape[3]} but query's is {query.shape[2]}")
    if query.shape[1] % key_cache.shape[2]:
        raise ValueError(f"query's {query.shape[1]} heads must be a multiple of the cache's "
                         f"{key_cache.shape[2]} kv heads")
    num_seqs = seq_lens.shape[0]
    for name, t, shape in (("seq_lens", seq_lens, (num_seqs,)), ("query_start_loc", query_start_loc, (num_seqs + 1,))):
        if t.dtype != torch.int32 or tuple(t.shape) != shape or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous int32 tensor of shape {shape}, "
                             f"got {t.dtype} {tuple(t.shape)}")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.shape[0] != num_seqs \
            or block_tables.stride(1) != 1:
        raise ValueError(f"block_tables must be int32 [num_seqs={num_seqs}, max_blocks] with a contiguous last "
                         f"dimension, got {block_tables.dtype} {tuple(block_tables.shape)}")


def paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """ops.paged_attention's arguments and result, plus max_query_len: an upper
    bound on any sequence's new tokens (query tiles past it are not launched).
    query and out may have any token and head strides (e.g. views of a fused
    qkv); the caches must be contiguous."""
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    _check(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, out)
    if max_query_len < 0:
        raise ValueError(f"max_query_len must be >= 0, got {max_query_len}")
    num_tokens, num_heads, head_size = query.shape
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0 or max_query_len == 0:
        return out
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    head_pad = _head_pad(head_size)
    config = _tile_config(head_pad, max_query_len, query.dtype)
    tiles_per_seq = triton.cdiv(max_query_len, config["BLOCK_M"])
    widen = _INTERPRETING and query.dtype == torch.bfloat16
    device = torch.cuda.device(query.device) if query.is_cuda else contextlib.nullcontext()
    with device:
        _paged_prefill_kernel[(num_seqs * tiles_per_seq * num_heads,)](
            out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
            scale * _LOG2_E,
            query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
            block_tables.stride(0),
            num_heads,
            tiles_per_seq,
            GROUP=num_heads // num_kv_heads,
            HEAD_SIZE=head_size,
            HEAD_PAD=head_pad,
            BLOCK_SIZE=block_size,
            # fp32 inputs: full-precision products (TF32 would lose ~3 digits);
            # 16-bit inputs: the backend's default.
            PRECISION="ieee" if query.dtype == torch.float32 or widen else None,
            WIDEN=widen,
            **config,
        )  # fmt: skip
    return out
