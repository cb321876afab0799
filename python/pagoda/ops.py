"""Python face of the compiled ops (torch.ops.pagoda.*), and their pure-torch
references.

The wrappers allocate outputs and pass through to the op; the op itself checks
dtypes, devices and shapes (TypeError/ValueError naming the argument). The
`*_reference` functions define what each kernel computes; tests compare the
kernels with them.
"""

from __future__ import annotations

import torch

from pagoda import _native

_C = _native.load()


# Fake (meta) implementations, for torch.compile and CUDA-graph tracing: every
# op mutates its arguments in place and returns nothing.
for _name in (
    "rms_norm",
    "fused_add_rms_norm",
    "silu_and_mul",
    "rotary_embedding",
    "reshape_and_cache",
    "rope_and_cache",
    "paged_attention",
    "linear",
    "gguf_linear",
    "gguf_embedding",
    "gguf_to_panels",
    "llama_decoder_layers",
    "gumbel_argmax",
    "greedy_argmax",
    "sample",
):
    torch.library.register_fake(f"pagoda::{_name}")(lambda *args, **kwargs: None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """weight * (x / sqrt(mean(x^2) + eps)), normalized in fp32 (as Hugging Face's LlamaRMSNorm)."""
    if out is None:
        out = torch.empty_like(x)
    torch.ops.pagoda.rms_norm(out, x, weight, eps)
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place: residual += x; x = rms_norm(residual)."""
    torch.ops.pagoda.fused_add_rms_norm(x, residual, weight, eps)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x = [gate | up] on the last dimension; returns silu(gate) * up."""
    if out is None:
        out = torch.empty(*x.shape[:-1], x.shape[-1] // 2, dtype=x.dtype, device=x.device)
    torch.ops.pagoda.silu_and_mul(out, x)
    return out


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> None:
    """In place on query and key: rotate the first rot_dim dims of each head by
    the angles of cos_sin_cache[positions] (NeoX or GPT-J pairing)."""
    torch.ops.pagoda.rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """In place: key_cache/value_cache [num_blocks, block_size, num_kv_heads,
    head_size] get key[t]/value[t] ([num_tokens, num_kv_heads, head_size]) at
    slot slot_mapping[t] = block * block_size + offset (int64); a negative slot
    skips the token (padding). On the CPU a slot past the cache's end is a
    ValueError; on CUDA (no host sync) such a token is skipped."""
    torch.ops.pagoda.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


def rope_and_cache(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
) -> None:
    """What an attention layer does to its new q/k/v before attending, in
    place: rms_norm over each head of query (key) with q_norm_weight
    (k_norm_weight) where given, then rotary_embedding of both, then
    reshape_and_cache of key and value ([num_tokens, heads * head_size] rows,
    strided views of a fused qkv output are fine; positions 1-D). One kernel
    on CUDA; the three ops in turn on the CPU."""
    torch.ops.pagoda.rope_and_cache(
        positions, query, key, value, key_cache, value_cache, slot_mapping, head_size, cos_sin_cache,
        q_norm_weight, k_norm_weight, is_neox, eps,
    )


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of every sequence's new tokens over its paged KV cache
    (prefill, chunked prefill, prefix-cache hits and decode in one call; the
    new tokens' K/V must already be in the cache, see reshape_and_cache).

    query, out: [num_tokens, num_heads, head_size]; the tokens of sequence s
    are rows query_start_loc[s] .. query_start_loc[s+1]-1 (int32, num_seqs+1
    entries). seq_lens (int32) counts each sequence's cached tokens including
    the new ones; block_tables (int32 [num_seqs, max_blocks]) lists its cache
    blocks. New token j of a sequence with q_len new tokens sits at position
    seq_len - q_len + j and sees positions 0 .. that one. GQA: query head h
    reads kv head h // (num_heads // num_kv_heads).

    The CPU checks the metadata values; CUDA does not (that would sync with
    the device): it plans its launch from shapes alone, so it can be captured
    in a CUDA graph and replayed with other metadata contents, and bad values
    give wrong results rather than out-of-bounds accesses."""
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    torch.ops.pagoda.paged_attention(out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale)
    return out


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """x @ weight.T (+ bias), as torch.nn.functional.linear: x [..., K] (rows
    may be strided, last dimension contiguous), weight [N, K] contiguous, bias
    [N]; summed in fp32, rounded once to x's dtype. Fast for few rows (decode);
    for many rows torch's GEMM is faster."""
    if out is None:
        out = torch.empty(*x.shape[:-1], weight.shape[0], dtype=x.dtype, device=x.device)
    torch.ops.pagoda.linear(out, x, weight, bias)
    return out


# GGUF block formats with CPU kernels: GGML's type id -> (weights, bytes) per
# block. Q4_0, Q4_1, Q8_0: GGUF_BLOCK weights (an fp16 scale, Q4_1 also an fp16
# minimum, then the quants); the K-quants Q4_K, Q6_K: super-blocks of 256.
GGUF_BLOCK = 32
# Pagoda's own type (never in a file; cc/cpu/kernels.h): Q8_0 blocks whose
# scale is shared by each group of q8_0_group_blocks(K) blocks of a row, so
# that the int8 path sums a group in one integer accumulator (layers/int8.py
# requantizes weights to it).
Q8_0_GROUPED = 1008
GGUF_BLOCKS = {2: (32, 18), 3: (32, 20), 8: (32, 34), 12: (256, 144), 14: (256, 210), Q8_0_GROUPED: (32, 34)}
# The formats gguf_linear's quantize_input takes: all of them.
GGUF_INT8_TYPES = tuple(GGUF_BLOCKS)


def gguf_in_features(weight: torch.Tensor, weight_type: int) -> int:
    """The logical in_features of a GGUF-packed weight uint8 [N, row bytes]."""
    values, nbytes = GGUF_BLOCKS[weight_type]
    return weight.shape[1] // nbytes * values


def q8_0_group_blocks(in_features: int) -> int:
    """Q8_0_GROUPED's blocks of 32 per group in rows of in_features: the most,
    up to 8 (256 values, llama.cpp's Q8_K input blocks), that divide the row
    (the kernel's rule, cc/cpu/kernels.h)."""
    nb = in_features // GGUF_BLOCK
    return next(g for g in range(8, 0, -1) if nb % g == 0)


def gguf_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_type: int,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    quantize_input: bool = False,
) -> torch.Tensor:
    """x @ W.T (+ bias) for fp32 x [..., K] and W [N, K] kept packed in GGUF's
    block layout: weight is uint8 [N, K / B * bytes] for (B, bytes) =
    GGUF_BLOCKS[weight_type] (K must be a multiple of B, as GGUF requires of
    every quantized row).
    The CPU kernel dequantizes W's blocks in registers and multiplies in fp32
    (gguf_linear_reference up to the order of fp32 sums); quantize_input=True
    instead rounds x to int8 per 32-element block (Q8_0_GROUPED: per group;
    scale max|x| / 127) and sums integer products (llama.cpp's way; gguf_linear_reference with
    quantize_input=True up to the order of sums); the weight must then be in
    the panel layout (gguf_to_panels)."""
    if out is None:
        out = torch.empty(*x.shape[:-1], weight.shape[0], dtype=torch.float32, device=x.device)
    torch.ops.pagoda.gguf_linear(out, x, weight, weight_type, bias, quantize_input)
    return out


def gguf_embedding(
    ids: torch.Tensor, weight: torch.Tensor, weight_type: int, embedding_dim: int, panels: bool = False
) -> torch.Tensor:
    """Rows ids of a GGUF-packed table (as in gguf_linear; panels: in the
    panel layout of gguf_to_panels), dequantized to fp32:
    [*ids.shape, embedding_dim]; only the looked-up rows are decoded."""
    out = torch.empty(*ids.shape, embedding_dim, dtype=torch.float32, device=ids.device)
    torch.ops.pagoda.gguf_embedding(out, ids.contiguous(), weight, weight_type, panels)
    return out


def gguf_to_panels(weight: torch.Tensor, weight_type: int) -> torch.Tensor:
    """Rewrites a GGUF-packed weight uint8 [N, row bytes] in place into the
    panel layout that gguf_linear's int8 path (quantize_input=True) reads:
    each whole group of 16 rows transposed so that one 512-bit load holds 16
    rows' quants (the layout: cc/cpu/gguf.cc; gguf_panels_reference), the
    rows past the last group as they were. Same bytes, so no second copy.
    Returns weight."""
    torch.ops.pagoda.gguf_to_panels(weight, weight_type, gguf_in_features(weight, weight_type))
    return weight


# llama_decoder_layers' weight type of a dense [N, K] weight in the
# activations' dtype (multiplied as ops.linear does); other types are GGUF's.
DENSE_WEIGHT = -1


def llama_decoder_layers(
    hidden: torch.Tensor,
    residual: torch.Tensor,
    positions: torch.Tensor,
    weights: list[torch.Tensor],
    weight_types: list[int],
    kv_caches: list[torch.Tensor],
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    scale: float,
    eps: float,
    quantize_input: bool = False,
) -> None:
    """A llama-family model's decoder layers in one call, in place (CPU; GGUF-
    packed linears in fp32, or dense ones in any dtype, no biases): per layer,
    qkv = gguf_linear(hidden) (linear for a DENSE_WEIGHT),
    rotary_embedding on q and k, reshape_and_cache of k and v,
    paged_attention, o_proj, fused_add_rms_norm with the post-attention norm,
    gate_up, silu_and_mul, down, fused_add_rms_norm with the norm after the
    layer. hidden [num_tokens, hidden_size] enters as layer 0's normalized
    input and leaves as the last norm's output; residual enters as the
    embeddings. Per layer: weights = (qkv, o, post-attention norm, gate_up,
    down, next norm), weight_types = GGUF types of (qkv, o, gate_up, down)
    or DENSE_WEIGHT,
    kv_caches = (key cache, value cache). quantize_input: the packed
    linears multiply inputs rounded to int8 (gguf_linear's; their weights in
    the panel layout of gguf_to_panels).
    llama_decoder_layers_reference is the same in torch."""
    torch.ops.pagoda.llama_decoder_layers(
        hidden, residual, positions, weights, weight_types, kv_caches, cos_sin_cache, is_neox, slot_mapping,
        block_tables, seq_lens, query_start_loc, num_heads, num_kv_heads, head_size, scale, eps, quantize_input,
    )


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token id (int64) per row of logits [num_rows, vocab_size], chosen
    as Sampler._sample chooses it: argmax where temperature is 0, otherwise
    temperature -> min_p -> top_k -> top_p -> exponential race, whose noise is
    keyed by (seeds[row], offsets[row], token id) only, so a row gets the same
    token in any batch. Per-row tensors on logits' device: temperature, top_p,
    min_p float32; top_k, seeds, offsets int64; None turns a filter off for
    every row. CUDA only (cuda/sampling.cu); sample_reference is the same in
    torch."""
    if out is None:
        out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    torch.ops.pagoda.sample(out, logits, temperature, top_k, top_p, min_p, seeds, offsets)
    return out


def gumbel_argmax(
    logits: torch.Tensor, seeds: torch.Tensor, offsets: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Per row of float32 logits [num_rows, vocab_size], argmax(logits +
    sample_gumbel(seeds, offsets, vocab_size)): the exponential race of
    sample() over logits that are already scaled and filtered (-inf drops a
    token), with its noise stream. CPU (cc/cpu/sampling.cc);
    gumbel_argmax_reference is the same in torch."""
    if out is None:
        out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    torch.ops.pagoda.gumbel_argmax(out, logits, seeds, offsets)
    return out


def greedy_argmax(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """logits.argmax(dim=-1) of float32 logits [num_rows, vocab_size] (NaN
    wins, ties go to the lower index) on the CPU, threaded, with vector
    compares (cc/cpu/sampling.cc): 0.15 against torch's 0.49 ms for 16 rows
    of 49k tokens on 2 Zen 4 cores."""
    if out is None:
        out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    torch.ops.pagoda.greedy_argmax(out, logits)
    return out


# --- pure-torch references -------------------------------------------------


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * h.to(x.dtype).float()).to(x.dtype)


def fused_add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns the new (x, residual)."""
    new_residual = (x.float() + residual.float()).to(x.dtype)
    return rms_norm_reference(new_residual, weight, eps), new_residual


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    gate = torch.nn.functional.silu(x[..., :d].float()).to(x.dtype)
    return (gate.float() * x[..., d:].float()).to(x.dtype)


def rotary_embedding_reference(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns rotated copies of (query, key)."""
    rot_dim = cos_sin_cache.shape[-1]
    cos, sin = cos_sin_cache[positions.flatten()].float().chunk(2, dim=-1)

    def rotate(t: torch.Tensor) -> torch.Tensor:
        shape = t.shape
        per_token = t.flatten(positions.dim()).unflatten(-1, (-1, head_size))
        heads = per_token.reshape(positions.numel(), per_token.shape[-2], head_size).float()
        rot, rest = heads[..., :rot_dim], heads[..., rot_dim:]
        c, s = cos[:, None, :], sin[:, None, :]
        if is_neox:
            x1, x2 = rot.chunk(2, dim=-1)
            rotated = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            rotated = torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2)
        return torch.cat([rotated, rest], dim=-1).to(t.dtype).reshape(shape)

    return rotate(query), None if key is None else rotate(key)


def rotary_cos_sin_cache(
    head_size: int, max_position: int, base: float = 10000.0, rot_dim: int | None = None, dtype=torch.float32
) -> torch.Tensor:
    """The [max_position, rot_dim] cos|sin table of standard RoPE."""
    rot_dim = head_size if rot_dim is None else rot_dim
    inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim))
    angles = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
    return torch.cat([angles.cos(), angles.sin()], dim=-1).to(dtype)


def reshape_and_cache_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns updated copies of (key_cache, value_cache); K/V rounded to the
    caches' dtype by torch (a bf16 cache under fp32 K/V)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    new_caches = []
    for new, cache in ((key, key_cache), (value, value_cache)):
        flat = cache.clone().flatten(0, 1)  # [num_slots, num_kv_heads, head_size]
        flat[slots] = new[keep].to(cache.dtype)
        new_caches.append(flat.view(cache.shape))
    return new_caches[0], new_caches[1]


def rope_and_cache_reference(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (query, key, key_cache, value_cache) as rope_and_cache leaves
    them, computed on copies."""

    def head_norm(x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        if weight is None:
            return x
        return rms_norm_reference(x.reshape(-1, head_size), weight, eps).view(x.shape)

    query, key = head_norm(query, q_norm_weight), head_norm(key, k_norm_weight)
    query, key = rotary_embedding_reference(positions, query, key, head_size, cos_sin_cache, is_neox)
    heads = (positions.numel(), key_cache.shape[2], head_size)
    return (query, key, *reshape_and_cache_reference(key.view(heads), value.reshape(heads), key_cache, value_cache,
                                                      slot_mapping))


def paged_attention_reference(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Sequence by sequence: gathers its K/V from the cache and computes causal
    softmax(scale * q k^T) v in compute_dtype; returns [num_tokens, num_heads,
    head_size] in query's dtype."""
    num_tokens, num_heads, head_size = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty(num_tokens, num_heads, head_size, dtype=compute_dtype, device=query.device)
    starts = query_start_loc.tolist()
    for s, seq_len in enumerate(seq_lens.tolist()):
        begin, end = starts[s], starts[s + 1]
        if begin == end:
            continue
        blocks = block_tables[s, : (seq_len + block_size - 1) // block_size].long()

        def gather(cache: torch.Tensor) -> torch.Tensor:  # [num_heads, seq_len, head_size]
            rows = cache[blocks].flatten(0, 1)[:seq_len].to(compute_dtype)
            return rows.repeat_interleave(group, dim=1).transpose(0, 1)

        q = query[begin:end].to(compute_dtype).transpose(0, 1)  # [num_heads, q_len, head_size]
        scores = scale * (q @ gather(key_cache).transpose(1, 2))  # [num_heads, q_len, seq_len]
        positions = torch.arange(seq_len - (end - begin), seq_len, device=query.device)
        visible = torch.arange(seq_len, device=query.device)[None, :] <= positions[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        out[begin:end] = (scores.softmax(dim=-1) @ gather(value_cache)).transpose(0, 1)
    return out.to(query.dtype)


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias in fp64, rounded once to x's dtype."""
    b = None if bias is None else bias.double()
    return torch.nn.functional.linear(x.double(), weight.double(), b).to(x.dtype)


def gguf_dequantize_reference(weight: torch.Tensor, weight_type: int) -> torch.Tensor:
    """fp32 [N, K] from GGUF blocks uint8 [N, row bytes] (layouts: see
    cc/cpu/gguf.cc), in the fp32 operations of gguf-py's dequantize: Q8_0
    d * q; Q4_0 d * (q - 8); Q4_1 d * q + m, with 4-bit quant j of a block in
    the low nibble of byte j (j < 16) or the high nibble of byte j - 16; Q4_K
    (d * sc) * q - dmin * m per sub-block of 32; Q6_K (d * sc) * (q - 32) per
    16 weights."""
    rows = weight.shape[0]
    blocks = weight.reshape(rows, -1, GGUF_BLOCKS[weight_type][1])
    nb = blocks.shape[1]

    def fp16(offset: int) -> torch.Tensor:
        return blocks[..., offset : offset + 2].contiguous().view(torch.float16).float()

    if weight_type == 12:
        # 6-bit scales and minimums: bytes 0-3 and 4-7 hold sc and m of
        # sub-blocks 0-3 (low 6 bits); bytes 8-11 the low 4 bits of 4-7, whose
        # top 2 bits are the top bits of bytes 0-3 (sc) and 4-7 (m).
        packed = blocks[..., 4:16].long()
        low_sc, low_m, nibbles = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
        sc = torch.cat([low_sc & 63, (nibbles & 15) | (low_sc >> 6 << 4)], dim=-1).float()
        m = torch.cat([low_m & 63, (nibbles >> 4) | (low_m >> 6 << 4)], dim=-1).float()
        qs = blocks[..., 16:].reshape(rows, nb, 4, 1, 32)
        q = torch.cat([qs & 15, qs >> 4], dim=-2).reshape(rows, nb, 8, 32).float()
        values = (fp16(0) * sc).unsqueeze(-1) * q - (fp16(2) * m).unsqueeze(-1)
    elif weight_type == 14:
        ql = blocks[..., :128].reshape(rows, nb, 2, 1, 64)
        low = torch.cat([ql & 15, ql >> 4], dim=-2).reshape(rows, nb, 256)
        qh = blocks[..., 128:192].reshape(rows, nb, 2, 1, 32)
        high = torch.cat([qh >> shift & 3 for shift in (0, 2, 4, 6)], dim=-2).reshape(rows, nb, 256)
        q = ((low | high << 4).float() - 32).reshape(rows, nb, 16, 16)
        sc = blocks[..., 192:208].contiguous().view(torch.int8).float()
        values = (fp16(208) * sc).unsqueeze(-1) * q
    elif weight_type in (8, Q8_0_GROUPED):
        values = fp16(0) * blocks[..., 2:].contiguous().view(torch.int8).float()
    else:
        qs = blocks[..., 4:] if weight_type == 3 else blocks[..., 2:]
        q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).float()
        values = fp16(0) * q + fp16(2) if weight_type == 3 else fp16(0) * (q - 8)
    return values.reshape(rows, -1)


# Where each block's fp16 scales (and minimums) lie, and the spread of the
# random ones gguf_random_blocks writes there: the K-quants' super-block scales
# multiply 6- or 8-bit sub-block scales.
_GGUF_FP16_FIELDS = {2: ((0, 0.02),), 3: ((0, 0.02), (2, 0.02)), 8: ((0, 0.02),), 12: ((0, 1e-3), (2, 1e-3)),
                     14: ((208, 1e-3),), Q8_0_GROUPED: ((0, 0.02),)}


def gguf_random_blocks(n: int, k: int, weight_type: int) -> torch.Tensor:
    """A valid random GGUF-packed weight [n, k] (for tests and benchmarks):
    every quant byte random (so every quant pattern: Q8_0's -128, which GGUF's
    quantizer never writes; every K-quant sub-block scale and minimum), fp16
    scales and minimums normal with both signs (Q8_0_GROUPED's the same
    across each group)."""
    values, nbytes = GGUF_BLOCKS[weight_type]
    blocks = torch.randint(0, 256, (n, k // values, nbytes), dtype=torch.uint8)
    group = q8_0_group_blocks(k) if weight_type == Q8_0_GROUPED else 1
    for offset, spread in _GGUF_FP16_FIELDS[weight_type]:
        halves = (torch.randn(n, k // values // group, 1) * spread).to(torch.float16).repeat_interleave(group, dim=1)
        blocks[..., offset : offset + 2] = halves.view(torch.uint8)
    return blocks.reshape(n, -1)


def gguf_fp16_offsets(weight_type: int) -> tuple[int, ...]:
    """Byte offsets of a block's fp16 scale (and minimum) fields."""
    return tuple(offset for offset, _ in _GGUF_FP16_FIELDS[weight_type])


# Where a block's fp16 fields lie, for the panel layout: (first byte, bytes).
_PANEL_FP16_FIELDS = {2: (0, 2), 3: (0, 4), 8: (0, 2), 12: (0, 4), 14: (208, 2), Q8_0_GROUPED: (0, 2)}


def _panel_sources(rows: int, row_bytes: int, weight_type: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For the panel layout of [rows, row_bytes] (the whole 16-row groups'
    bytes): the index of the file's byte each panel byte holds, and which
    panel bytes are Q8_0 quants (stored + 128)."""
    block_bytes = GGUF_BLOCKS[weight_type][1]
    at, size = _PANEL_FP16_FIELDS[weight_type]
    groups, nb = rows // 16, row_bytes // block_bytes
    source = torch.arange(groups * 16 * row_bytes).reshape(groups, 16, nb, block_bytes)
    # words (the bytes but the fp16 fields, in file order): [group, block, vector j, row, 4 bytes];
    # fp16s: [group, field, block, row, 2 bytes]
    vectors = (block_bytes - size) // 4
    words = torch.cat([source[..., :at], source[..., at + size :]], dim=-1)
    quants = words.reshape(groups, 16, nb, vectors, 4).permute(0, 2, 3, 1, 4).reshape(groups, nb * vectors * 64)
    fp16 = source[..., at : at + size]
    fp16s = fp16.reshape(groups, 16, nb, size // 2, 2).permute(0, 3, 2, 1, 4).reshape(groups, nb * size * 16)
    offset = torch.zeros(groups, 16 * row_bytes, dtype=torch.bool)
    if weight_type in (8, Q8_0_GROUPED):
        offset[:, : quants.shape[1]] = True
    return torch.cat([quants, fp16s], dim=1).flatten(), offset.flatten()


def gguf_panels_reference(weight: torch.Tensor, weight_type: int) -> torch.Tensor:
    """gguf_to_panels's result, computed out of place in torch."""
    rows, row_bytes = weight.shape
    source, offset = _panel_sources(rows, row_bytes, weight_type)
    panels = weight.flatten()[source]
    panels[offset] ^= 0x80
    return torch.cat([panels, weight[rows // 16 * 16 :].flatten()]).reshape(rows, row_bytes)


def gguf_from_panels_reference(panels: torch.Tensor, weight_type: int) -> torch.Tensor:
    """The file's layout back from the panel layout (gguf_panels_reference's
    inverse), for the references of the int8 path."""
    rows, row_bytes = panels.shape
    source, offset = _panel_sources(rows, row_bytes, weight_type)
    weight = panels.clone().flatten()
    stored = panels.flatten()[: source.numel()].clone()
    stored[offset] ^= 0x80
    weight[source] = stored
    return weight.reshape(rows, row_bytes)


def gguf_quantize_input_reference(x: torch.Tensor, group: int = 1) -> torch.Tensor:
    """x (fp32, last dim a multiple of 32 * group) as gguf_linear's kernel
    sees it: each block of 32 * group values (Q8_0_GROUPED's group, else 1)
    rounded to d * round(x * (127 / max|x|)), d = max|x| / 127, in fp32 as
    the kernel computes it (ties to even)."""
    blocks = x.float().reshape(*x.shape[:-1], -1, GGUF_BLOCK * group)
    amax = blocks.abs().amax(-1, keepdim=True)
    # A tensor by a tensor: torch's scalar-by-tensor division (127 / amax)
    # multiplies by a reciprocal, an ulp off the kernel's 127.0f / max.
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, 0)
    return (torch.round(blocks * inv) * (amax / 127)).reshape(x.shape)


def gguf_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_type: int,
    bias: torch.Tensor | None = None,
    quantize_input: bool = False,
) -> torch.Tensor:
    """x @ dequantize(W).T + bias in fp64, as fp32; quantize_input=True first
    rounds x as the kernel does (gguf_quantize_input_reference), so that only
    the order of fp32 sums differs from the kernel."""
    if quantize_input:
        x = gguf_quantize_input_reference(x, q8_0_group_blocks(x.shape[-1]) if weight_type == Q8_0_GROUPED else 1)
    return linear_reference(x.double(), gguf_dequantize_reference(weight, weight_type), bias).float()


def _layer_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, weight_type: int, quantize_input: bool
) -> torch.Tensor:
    if weight_type == DENSE_WEIGHT:
        return linear_reference(x, weight)
    if quantize_input and weight_type in GGUF_INT8_TYPES:  # the int8 path's weights are panels
        return gguf_linear_reference(x, gguf_from_panels_reference(weight, weight_type), weight_type,
                                     quantize_input=True)
    return gguf_linear_reference(x, weight, weight_type)


def llama_decoder_layers_reference(
    hidden: torch.Tensor,
    residual: torch.Tensor,
    positions: torch.Tensor,
    weights: list[torch.Tensor],
    weight_types: list[int],
    kv_caches: list[torch.Tensor],
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    scale: float,
    eps: float,
    quantize_input: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """llama_decoder_layers from the other ops' references; returns the new
    (hidden, residual, kv_caches)."""
    tokens, q_size, kv_size = hidden.shape[0], num_heads * head_size, num_kv_heads * head_size
    caches = list(kv_caches)
    for layer in range(len(weight_types) // 4):
        qkv_w, o_w, post_norm, gate_up_w, down_w, next_norm = weights[6 * layer : 6 * layer + 6]
        qkv_type, o_type, gate_up_type, down_type = weight_types[4 * layer : 4 * layer + 4]
        qkv = _layer_linear_reference(hidden, qkv_w, qkv_type, quantize_input)
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q, k = rotary_embedding_reference(positions, q, k, head_size, cos_sin_cache, is_neox)
        k, v = k.reshape(tokens, num_kv_heads, head_size), v.reshape(tokens, num_kv_heads, head_size)
        caches[2 * layer], caches[2 * layer + 1] = reshape_and_cache_reference(
            k, v, caches[2 * layer], caches[2 * layer + 1], slot_mapping
        )
        attn = paged_attention_reference(
            q.reshape(tokens, num_heads, head_size), caches[2 * layer], caches[2 * layer + 1], block_tables,
            seq_lens, query_start_loc, scale,
        )
        x, residual = fused_add_rms_norm_reference(
            _layer_linear_reference(attn.reshape(tokens, q_size), o_w, o_type, quantize_input), residual, post_norm, eps
        )
        act = silu_and_mul_reference(_layer_linear_reference(x, gate_up_w, gate_up_type, quantize_input))
        hidden, residual = fused_add_rms_norm_reference(
            _layer_linear_reference(act, down_w, down_type, quantize_input), residual, next_norm, eps
        )
    return hidden, residual, caches


_WORD = 0xFFFFFFFF


def _mul_hi_lo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32-bit words of a * b for a 32-bit constant a and 32-bit
    values b, in int64 arithmetic that cannot overflow (b split in halves)."""
    high, low = a * (b >> 16), a * (b & 0xFFFF)  # each < 2^48
    return (high + (low >> 16)) >> 16, (((high & 0xFFFF) << 16) + low) & _WORD


def philox4x32_10(counter: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """Philox4x32-10 (Salmon et al., SC 2011): counters [..., 4] under keys
    [..., 2] (32-bit words held in int64 tensors) -> [..., 4] random words."""
    c0, c1, c2, c3 = counter.unbind(-1)
    k0, k1 = key.unbind(-1)
    for _ in range(10):
        hi0, lo0 = _mul_hi_lo(0xD2511F53, c0)
        hi1, lo1 = _mul_hi_lo(0xCD9E8D57, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + 0x9E3779B9) & _WORD, (k1 + 0xBB67AE85) & _WORD
    return torch.stack([c0, c1, c2, c3], dim=-1)


def sample_gumbel(seeds: torch.Tensor, offsets: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The race noise of pagoda::sample, [num_rows, vocab_size] float32: token
    i of row r gets -log(E), E = -log1p(-u), u = (w + 0.5) / 2^32, where w is
    word i % 4 of Philox4x32-10 under key seeds[r] (low word first) at counter
    (i // 4, 0, offsets[r] low word, offsets[r] high word)."""
    n = seeds.shape[0]
    groups = torch.arange((vocab_size + 3) // 4, device=seeds.device).expand(n, -1)
    counter = torch.stack(
        [groups, torch.zeros_like(groups), (offsets[:, None] & _WORD).expand_as(groups),
         ((offsets[:, None] >> 32) & _WORD).expand_as(groups)],
        dim=-1,
    )  # fmt: skip
    key = torch.stack([seeds & _WORD, (seeds >> 32) & _WORD], dim=-1)[:, None, :]
    words = philox4x32_10(counter, key).flatten(1)[:, :vocab_size]
    u = (words.float() + 0.5) * 2.0**-32
    return -torch.log(-torch.log1p(-u))


def gumbel_argmax_reference(logits: torch.Tensor, seeds: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """gumbel_argmax in torch. The kernel's logs differ from torch's in the
    last bits, so it picks the same tokens unless that breaks a near-tie."""
    return (logits + sample_gumbel(seeds, offsets, logits.shape[1])).argmax(dim=-1)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """Drop tokens whose probability is below min_p times the top probability."""
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    logits.masked_fill_(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> None:
    """Keep the k largest logits (ties with the k-th kept too), then the smallest
    set of most likely tokens whose probability reaches p (always at least one).
    One ascending sort serves both."""
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
        kth = sorted_logits.gather(1, (vocab - k).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        drop = cum <= 1 - top_p.unsqueeze(1)
        drop[:, -1] = False
        sorted_logits.masked_fill_(drop, float("-inf"))
    logits.scatter_(1, order, sorted_logits)


def sample_reference(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """pagoda::sample in torch: Sampler's own filters (a sort), then
    argmax(l + sample_gumbel(...)) over the kept tokens; argmax of the logits
    where temperature is 0. The kernel picks the same tokens unless rounding
    moves a token across a filter's boundary or breaks a near-tie of scores."""
    x = logits.float()
    greedy = temperature == 0
    scaled = x / torch.where(greedy, 1.0, temperature)[:, None]
    if min_p is not None:
        apply_min_p(scaled, min_p)
    if top_k is not None or top_p is not None:
        apply_top_k_top_p(scaled, top_k, top_p)
    sampled = (scaled + sample_gumbel(seeds, offsets, x.shape[1])).argmax(dim=-1)
    return torch.where(greedy, x.argmax(dim=-1), sampled)
