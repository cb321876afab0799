"""gguf_linear and gguf_embedding (GGUF-packed Q4_0, Q4_1, Q8_0 weights, and
the K-quants Q4_K, Q6_K) against the pure-torch dequantize-then-multiply
references, for both ways of multiplying a block.

fp32 (the default): the kernel dequantizes the weight to exactly the
reference's fp32 values and multiplies in fp32, so only the order of the fp32
sums differs from the fp64 reference: each output within (K / 8 + 8) * 2^-24 of
sum |x| |w| (+ |bias|), the worst case of summing K / 8 products per
vector lane and then the lanes (about 1.5e-5 at K = 1536; a wrong or
misplaced weight is off by about |w| |x|, a whole term).

int8 (quantize_input=True; the weight in the panel layout of
ops.gguf_to_panels, checked byte for byte against gguf_panels_reference, and
multiplied here against the file-layout weight it came from): the kernel
rounds each 32-element block of x to
int8 with step d = max|x_block| / 127, so every element moves by at most
d / 2, and an output moves by at most sum over blocks of d_b / 2 * sum_j
|w_j|. The tests check that bound per output element, plus fp32 rounding of
the block sums (1e-5 of sum |x| |w|). The bound is the worst case; typical
errors are about sqrt(32) times smaller, since the rounding errors have
random signs. Against the reference fed the same int8-rounded x, only fp32
summation order differs: within 1e-5 of sum |x| |w|.

Pagoda's Q8_0 grouped (ops.Q8_0_GROUPED: Q8_0 whose scale is shared by a
group of q8_0_group_blocks(K) blocks, --quantization int8) goes through all
of Q8_0's tests; its int8 path rounds x per group (the bound above with
groups for blocks), and the reference fed the same rounded x is held to
fp32 summation order as before, so a kernel rounding per 32 fails it.
"""

import pytest
import torch

from pagoda import ops

TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "Q8_0 grouped": ops.Q8_0_GROUPED}
K_QUANTS = {"Q4_K": 12, "Q6_K": 14}
ALL_TYPES = {**TYPES, **K_QUANTS}


def scaled(k: int, weight_type: int) -> int:
    """A row length of k / 32 blocks of the type (super-blocks of 256 for the K-quants)."""
    return k * ops.GGUF_BLOCKS[weight_type][0] // ops.GGUF_BLOCK


def magnitudes(x: torch.Tensor, weight: torch.Tensor, weight_type: int, bias=None) -> torch.Tensor:
    """sum |x| |w| (+ |bias|) per output element, [M, N] in fp64."""
    w = ops.gguf_dequantize_reference(weight, weight_type).double()
    scale = x.reshape(-1, x.shape[-1]).double().abs() @ w.abs().T
    return scale if bias is None else scale + bias.double().abs()


def int8_error_bound(x: torch.Tensor, weight: torch.Tensor, weight_type: int) -> torch.Tensor:
    x = x.reshape(-1, x.shape[-1]).double()
    w = ops.gguf_dequantize_reference(weight, weight_type).double()
    rows, k = w.shape
    block = ops.GGUF_BLOCK * (ops.q8_0_group_blocks(k) if weight_type == ops.Q8_0_GROUPED else 1)
    w = w.reshape(rows, -1, block)
    step = x.reshape(x.shape[0], -1, block).abs().amax(-1) / 127  # [M, blocks]
    quantization = torch.einsum("mb,nb->mn", step / 2, w.abs().sum(-1))
    rounding = 1e-5 * x.abs() @ w.reshape(rows, k).abs().T
    return quantization + rounding + 1e-6


def linear(x, weight, weight_type, bias=None, quantize_input=False):
    """ops.gguf_linear of the file-layout weight; the int8 path on a copy
    repacked into panels, as the loader does."""
    if quantize_input:
        weight = ops.gguf_to_panels(weight.clone(), weight_type)
    return ops.gguf_linear(x, weight, weight_type, bias, quantize_input=quantize_input)


def check(out, x, weight, weight_type, bias=None, quantize_input=False):
    want = ops.gguf_linear_reference(x, weight, weight_type, bias)
    assert out.shape == want.shape and out.dtype == torch.float32
    error = (out.double() - want.double()).reshape(-1, weight.shape[0]).abs()
    if not quantize_input:
        bound = (x.shape[-1] / 8 + 8) * 2.0**-24 * magnitudes(x, weight, weight_type, bias) + 1e-30
        assert (error <= bound).all(), f"max error {error.max():.3g}, worst error / bound {(error / bound).max():.3g}"
        return
    bound = int8_error_bound(x, weight, weight_type)
    assert (error <= bound).all(), f"max error {error.max():.3g}, worst error / bound {(error / bound).max():.3g}"
    same_input = ops.gguf_linear_reference(x, weight, weight_type, bias, quantize_input=True)
    summation = 1e-5 * magnitudes(x, weight, weight_type) + 1e-6
    error = (out.double() - same_input.double()).reshape(-1, weight.shape[0]).abs()
    assert (error <= summation).all(), f"against the int8-rounded input: max error {error.max():.3g}"


@pytest.mark.parametrize("quantize_input", [False, True], ids=["fp32", "int8"])
@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 17, 64, 65])
@pytest.mark.parametrize("k,n", [(32, 1), (64, 3), (96, 5), (576, 577), (1536, 64)])
def test_gguf_linear(name, m, k, n, quantize_input):
    weight_type = TYPES[name]
    weight = ops.gguf_random_blocks(n, k, weight_type)
    x = torch.randn(m, k)
    check(linear(x, weight, weight_type, quantize_input=quantize_input), x, weight, weight_type,
          quantize_input=quantize_input)


@pytest.mark.parametrize("quantize_input", [False, True], ids=["fp32", "int8"])
@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("m", [1, 17])
@pytest.mark.parametrize("n", [1, 7, 8, 9])
def test_gguf_linear_bias_and_odd_rows(name, m, n, quantize_input):
    """Output rows around the tiles' 2 and 4 weight rows, with a bias."""
    weight_type = TYPES[name]
    weight = ops.gguf_random_blocks(n, 160, weight_type)
    x, bias = torch.randn(m, 160), torch.randn(n)
    out = linear(x, weight, weight_type, bias, quantize_input)
    check(out, x, weight, weight_type, bias, quantize_input)


@pytest.mark.parametrize("name", TYPES)  # the formats quantize_input takes
@pytest.mark.parametrize("m", [1, 3, 4, 6, 7, 9, 17])
@pytest.mark.parametrize("n", [1, 8, 9, 15, 16, 17, 24, 31, 32, 33, 48, 65])
@pytest.mark.parametrize("k", [32, 96])
def test_gguf_linear_int8_panels(name, m, n, k):
    """The int8 path multiplies units of 16 weight rows (a panel; AVX2: 8,
    half a panel), two at a time on AVX512_VNNI, 4 input rows per tile; the
    rows past the last whole panel are built into one per call: output rows
    around the panels, their halves and pairs, input rows around the tile,
    one block and three per row, with a bias."""
    weight_type = TYPES[name]
    weight = ops.gguf_random_blocks(n, k, weight_type)
    x, bias = torch.randn(m, k), torch.randn(n)
    check(linear(x, weight, weight_type, bias, True), x, weight, weight_type, bias, True)


@pytest.mark.parametrize("name", ALL_TYPES)
def test_gguf_linear_int8_input_chunks(name):
    """Input rows in several chunks (the kernel takes 256 KB of quantized
    input rows at a time: 116 rows of 48 blocks), the last one partial."""
    weight_type = ALL_TYPES[name]
    weight = ops.gguf_random_blocks(40, 1536, weight_type)
    x = torch.randn(301, 1536)
    check(linear(x, weight, weight_type, quantize_input=True), x, weight, weight_type, quantize_input=True)


@pytest.mark.parametrize("name", ALL_TYPES)
@pytest.mark.parametrize("n,k", [(1, 32), (15, 64), (16, 32), (17, 96), (40, 64), (48, 576)])
def test_gguf_to_panels(name, n, k):
    """The kernel's in-place repacking is the torch reference's layout, byte
    for byte, and the reference's inverse gives the file's bytes back."""
    weight_type = ALL_TYPES[name]
    k = scaled(k, weight_type)
    weight = ops.gguf_random_blocks(n, k, weight_type)
    panels = ops.gguf_to_panels(weight.clone(), weight_type)
    assert torch.equal(panels, ops.gguf_panels_reference(weight, weight_type))
    assert torch.equal(ops.gguf_from_panels_reference(panels, weight_type), weight)
    if n >= 16:  # the layout moved the bytes
        assert not torch.equal(panels[:16], weight[:16])


def test_gguf_panels_reference_layout():
    """Spot checks of the layout as cc/cpu/gguf.cc states it, on Q4_1 (d, m)
    and Q8_0 (quants stored + 128): 17 rows of 2 blocks."""
    weight = ops.gguf_random_blocks(17, 64, 3)
    panels = ops.gguf_panels_reference(weight, 3).flatten()
    blocks = weight.reshape(17, 2, 20)
    # Block 1's vector 2, lane 5: row 5's quant bytes 8..11 (block bytes 12..15).
    assert torch.equal(panels[(1 * 4 + 2) * 64 + 5 * 4 :][:4], blocks[5, 1, 12:16])
    # The fp16 d of row 9, block 1: after the 2 x 4 vectors, at 32 b + 2 n.
    assert torch.equal(panels[8 * 64 + 32 + 18 :][:2], blocks[9, 1, 0:2])
    # The minimum m of row 3, block 0: after the 2 blocks' d.
    assert torch.equal(panels[8 * 64 + 64 + 6 :][:2], blocks[3, 0, 2:4])
    assert torch.equal(panels[16 * 40 :], weight[16])  # row 16: as in the file
    q8 = ops.gguf_random_blocks(16, 32, 8)
    assert torch.equal(ops.gguf_panels_reference(q8, 8).flatten()[7 * 64 + 15 * 4 :][:4], q8[15, 30:34] ^ 0x80)


def test_gguf_panels_reference_layout_k_quants():
    """The same for the K-quants, 16 rows of one super-block: Q4_K's d, dmin
    (bytes 0..3) after its 35 vectors (12 bytes of scales, 128 of quants);
    Q6_K's d (bytes 208..209) after its 52 (ql, qh, scales)."""
    q4k = ops.gguf_random_blocks(16, 256, 12)
    panels = ops.gguf_panels_reference(q4k, 12).flatten()
    assert torch.equal(panels[5 * 4 :][:4], q4k[5, 4:8])  # vector 0, lane 5: the first scale bytes
    assert torch.equal(panels[(3 + 8) * 64 + 2 * 4 :][:4], q4k[2, 16 + 32 : 16 + 36])  # quant bytes 32..35
    assert torch.equal(panels[35 * 64 + 7 * 2 :][:2], q4k[7, 0:2])
    assert torch.equal(panels[35 * 64 + 32 + 7 * 2 :][:2], q4k[7, 2:4])
    q6k = ops.gguf_random_blocks(16, 256, 14)
    panels = ops.gguf_panels_reference(q6k, 14).flatten()
    assert torch.equal(panels[48 * 64 + 9 * 4 :][:4], q6k[9, 192:196])  # the first int8 scales
    assert torch.equal(panels[52 * 64 + 9 * 2 :][:2], q6k[9, 208:210])


@pytest.mark.parametrize("quantize_input", [False, True], ids=["fp32", "int8"])
@pytest.mark.parametrize("name", TYPES)
def test_gguf_linear_many_rows_and_bias(name, quantize_input):
    """A vocabulary-sized output (the LM head of a tied GGUF model)."""
    weight_type = TYPES[name]
    weight = ops.gguf_random_blocks(9001, 64, weight_type)
    x, bias = torch.randn(3, 64), torch.randn(9001)
    out = linear(x, weight, weight_type, bias, quantize_input)
    check(out, x, weight, weight_type, bias, quantize_input)


@pytest.mark.parametrize("name", TYPES)
def test_gguf_linear_fp32_is_exact_on_exact_sums(name):
    """Scales, minimums and inputs that are small multiples of powers of two:
    every product and partial sum is exact in fp32, so the fp32 path must
    equal the reference bit for bit in any order of sums (a weight off by
    one step would show)."""
    weight_type = TYPES[name]
    weight = ops.gguf_random_blocks(9, 96, weight_type)
    blocks = weight.view(9, 3, -1)
    scales = torch.tensor([0.25, -0.5, 0.5], dtype=torch.float16)[torch.randint(0, 3, (9, 3))]
    blocks[..., 0:2] = scales.unsqueeze(-1).view(torch.uint8)
    if weight_type == 3:
        blocks[..., 2:4] = torch.tensor([-0.75], dtype=torch.float16).view(torch.uint8)
    x = torch.randint(-8, 9, (5, 96)).float() / 4
    assert torch.equal(ops.gguf_linear(x, weight, weight_type), ops.gguf_linear_reference(x, weight, weight_type))


def test_gguf_linear_outliers_and_zeros():
    """A block of zeros (scale 0) and a block with one large element."""
    weight = ops.gguf_random_blocks(7, 96, 3)
    x = torch.randn(2, 96)
    x[0, :32] = 0
    x[1, 40] = 1e4
    check(ops.gguf_linear(x, weight, 3), x, weight, 3)
    check(linear(x, weight, 3, quantize_input=True), x, weight, 3, quantize_input=True)


def test_gguf_linear_strided_and_leading_dims():
    weight = ops.gguf_random_blocks(10, 64, 8)
    x = torch.randn(6, 70)[:, 3:67]
    buffer = torch.zeros(6, 15)
    ops.gguf_linear(x, weight, 8, out=buffer[:, 2:12])
    check(buffer[:, 2:12], x, weight, 8)
    assert (buffer[:, :2] == 0).all() and (buffer[:, 12:] == 0).all()
    x3 = torch.randn(2, 3, 64)
    out = ops.gguf_linear(x3, weight, 8)
    assert out.shape == (2, 3, 10)
    check(out, x3, weight, 8)


def test_gguf_linear_empty():
    assert ops.gguf_linear(torch.randn(0, 64), ops.gguf_random_blocks(4, 64, 2), 2).shape == (0, 4)


def test_gguf_linear_errors():
    weight = ops.gguf_random_blocks(5, 64, 3)
    with pytest.raises(ValueError, match="multiple of Q4_1's block size 32"):
        ops.gguf_linear(torch.randn(2, 48), weight[:, :30].contiguous(), 3)
    with pytest.raises(ValueError, match="weight rows hold 40 bytes but in_features 96 needs 3 blocks of 20"):
        ops.gguf_linear(torch.randn(2, 96), weight, 3)
    with pytest.raises(ValueError, match="weight_type 13 is not a GGUF block format"):
        ops.gguf_linear(torch.randn(2, 64), weight, 13)
    with pytest.raises(TypeError, match="weight must be uint8"):
        ops.gguf_linear(torch.randn(2, 64), weight.float(), 3)
    with pytest.raises(TypeError, match="input must be float32"):
        ops.gguf_linear(torch.randn(2, 64).bfloat16(), weight, 3)
    with pytest.raises(ValueError, match="bias must be"):
        ops.gguf_linear(torch.randn(2, 64), weight, 3, torch.randn(4))
    with pytest.raises(ValueError, match="out must have shape"):
        torch.ops.pagoda.gguf_linear(torch.empty(2, 4), torch.randn(2, 64), weight, 3, None)


@pytest.mark.parametrize("name", TYPES)
def test_gguf_embedding(name):
    weight_type = TYPES[name]
    weight = ops.gguf_random_blocks(300, 96, weight_type)
    ids = torch.tensor([[0, 299, 7], [7, 150, 1]])
    out = ops.gguf_embedding(ids, weight, weight_type, 96)
    assert out.shape == (2, 3, 96)
    torch.testing.assert_close(out, ops.gguf_dequantize_reference(weight, weight_type)[ids], rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"ids\[1\] = 300 is outside the table's \[0, 300\)"):
        ops.gguf_embedding(torch.tensor([1, 300]), weight, weight_type, 96)


@pytest.mark.parametrize("name", ALL_TYPES)
def test_gguf_embedding_panels(name):
    """A table in the panel layout (a tied LM head of the int8 path): rows in
    whole panels, at their edges, and past the last one (300 = 18 x 16 + 12)."""
    weight_type = ALL_TYPES[name]
    k = scaled(96, weight_type)
    weight = ops.gguf_random_blocks(300, k, weight_type)
    panels = ops.gguf_to_panels(weight.clone(), weight_type)
    ids = torch.tensor([[0, 299, 7], [15, 16, 287], [288, 150, 1]])
    out = ops.gguf_embedding(ids, panels, weight_type, k, panels=True)
    torch.testing.assert_close(out, ops.gguf_dequantize_reference(weight, weight_type)[ids], rtol=0, atol=0)


@pytest.mark.parametrize("name", {**TYPES, **K_QUANTS})
def test_dequantize_reference_matches_gguf_package(name):
    """The reference's reading of the block layout is the gguf package's, to
    the bit (Q8_0 grouped's bytes are Q8_0's)."""
    gguf = pytest.importorskip("gguf")
    weight_type = {**TYPES, **K_QUANTS}[name]
    weight = ops.gguf_random_blocks(4, 512, weight_type)
    want = gguf.quants.dequantize(weight.numpy(), gguf.GGMLQuantizationType[name.split()[0]])
    torch.testing.assert_close(ops.gguf_dequantize_reference(weight, weight_type), torch.from_numpy(want), rtol=0, atol=0)


# The K-quants: super-blocks of 256 weights, fp32 path only.


# Input rows around the tiles' 4 and the 64-row input chunks; output rows
# around the 2- and 4-row tiles and the threads' ranges, and a vocabulary-sized
# LM head at few rows; 1 to 3 super-blocks per row.
K_QUANT_SHAPES = [(m, k, n) for m in (1, 2, 3, 17, 65) for k, n in ((256, 1), (512, 37), (768, 301))]
K_QUANT_SHAPES += [(1, 256, 9001), (3, 256, 9001)]


@pytest.mark.parametrize("quantize_input", [False, True], ids=["fp32", "int8"])
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("name", K_QUANTS)
@pytest.mark.parametrize("m,k,n", K_QUANT_SHAPES)
def test_gguf_linear_k_quants(name, m, k, n, bias, quantize_input):
    weight_type = K_QUANTS[name]
    weight = ops.gguf_random_blocks(n, k, weight_type)
    x = torch.randn(m, k)
    b = torch.randn(n) if bias else None
    check(linear(x, weight, weight_type, b, quantize_input), x, weight, weight_type, b, quantize_input)


@pytest.mark.parametrize("name", K_QUANTS)
@pytest.mark.parametrize("m", [1, 3, 4, 7, 8, 9, 17])
@pytest.mark.parametrize("n", [1, 9, 16, 17, 33, 48])
def test_gguf_linear_k_quants_int8_panels(name, m, n):
    """The K-quants' int8 path around the panels (as
    test_gguf_linear_int8_panels) and the input rows from which a tile's
    weights are decoded once per chunk (8), two super-blocks a row."""
    weight_type = K_QUANTS[name]
    weight = ops.gguf_random_blocks(n, 512, weight_type)
    x, bias = torch.randn(m, 512), torch.randn(n)
    check(linear(x, weight, weight_type, bias, True), x, weight, weight_type, bias, True)


@pytest.mark.parametrize("name", K_QUANTS)
def test_gguf_linear_k_quants_exact_on_exact_sums(name):
    """Super-block scales of +-1/16 and inputs in quarters: every weight,
    product and partial sum is exact in fp32 (below 2^24 units of 2^-6), so
    the kernel must equal the reference bit for bit; a sub-block scale,
    minimum or quant read from the wrong place would show."""
    weight_type = K_QUANTS[name]
    weight = ops.gguf_random_blocks(11, 256, weight_type)
    sixteenth = torch.tensor([0.0625, -0.0625], dtype=torch.float16)[torch.randint(0, 2, (11, 2))]
    for i, offset in enumerate(ops.gguf_fp16_offsets(weight_type)):
        weight[:, offset : offset + 2] = sixteenth[:, i : i + 1].view(torch.uint8)
    x = torch.randint(-4, 5, (5, 256)).float() / 4
    assert torch.equal(ops.gguf_linear(x, weight, weight_type), ops.gguf_linear_reference(x, weight, weight_type))


@pytest.mark.parametrize("name", K_QUANTS)
def test_gguf_embedding_k_quants(name):
    weight_type = K_QUANTS[name]
    weight = ops.gguf_random_blocks(50, 512, weight_type)
    ids = torch.tensor([[0, 49, 7], [7, 25, 1]])
    out = ops.gguf_embedding(ids, weight, weight_type, 512)
    torch.testing.assert_close(out, ops.gguf_dequantize_reference(weight, weight_type)[ids], rtol=0, atol=0)


def test_gguf_linear_k_quants_errors():
    weight = ops.gguf_random_blocks(5, 512, 14)
    with pytest.raises(ValueError, match=r"in_features \(288\) must be a multiple of Q6_K's block size 256"):
        ops.gguf_linear(torch.randn(2, 288), weight, 14)
    with pytest.raises(ValueError, match="in_features 256 needs 1 blocks of 144 bytes"):
        ops.gguf_linear(torch.randn(2, 256), weight, 12)
    with pytest.raises(ValueError, match=r"in_features \(288\) must be a multiple of Q6_K's block size 256"):
        ops.gguf_linear(torch.randn(2, 288), weight, 14, quantize_input=True)
    with pytest.raises(ValueError, match=r"in_features \(288\) must be a multiple of Q4_K's block size 256"):
        torch.ops.pagoda.gguf_to_panels(ops.gguf_random_blocks(5, 512, 12), 12, 288)


def test_gguf_opcheck():
    weight = ops.gguf_random_blocks(5, 64, 8)
    torch.library.opcheck(torch.ops.pagoda.gguf_linear.default, (torch.empty(3, 5), torch.randn(3, 64), weight, 8, None))
    torch.library.opcheck(torch.ops.pagoda.gguf_linear.default,
                          (torch.empty(3, 5), torch.randn(3, 64), weight, 8, None, True))
    torch.library.opcheck(torch.ops.pagoda.gguf_embedding.default, (torch.empty(2, 64), torch.tensor([0, 4]), weight, 8))
    torch.library.opcheck(torch.ops.pagoda.gguf_to_panels.default, (ops.gguf_random_blocks(17, 64, 8), 8, 64))
    k_quant = ops.gguf_random_blocks(5, 256, 12)
    torch.library.opcheck(torch.ops.pagoda.gguf_linear.default, (torch.empty(3, 5), torch.randn(3, 256), k_quant, 12, None))
