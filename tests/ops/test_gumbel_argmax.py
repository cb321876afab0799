"""pagoda::gumbel_argmax (the CPU race of sampling, cc/cpu/sampling.cc)
against its pure-torch reference: argmax(logits + ops.sample_gumbel(...));
pagoda::greedy_argmax (the same kernel without the noise) against
torch.argmax."""

import pytest
import torch
from op_testing import strided_rows

from pagoda import ops


def keys(rows: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeds over the whole int64 range (negative ones too) and offsets past 2^32."""
    seeds = torch.randint(-(2**63), 2**63 - 1, (rows,), generator=g)
    offsets = torch.randint(0, 2**40, (rows,), generator=g)
    return seeds, offsets


# Vocabularies around the kernel's batches of 64 tokens and work items of 4096,
# and SmolLM2's.
@pytest.mark.parametrize("vocab", [1, 3, 63, 64, 65, 1000, 4095, 4096, 4097, 12345, 49152])
@pytest.mark.parametrize("rows", [1, 2, 17])
def test_equals_reference(rows, vocab):
    g = torch.Generator().manual_seed(rows * 100003 + vocab)
    logits = strided_rows(rows, vocab, torch.float32, "cpu") * 3
    seeds, offsets = keys(rows, g)
    out = torch.full((rows,), -1, dtype=torch.int64)
    got = ops.gumbel_argmax(logits, seeds, offsets, out=out)
    assert got is out
    assert torch.equal(got, ops.gumbel_argmax_reference(logits, seeds, offsets))


def test_filtered_and_nan_logits_as_argmax():
    """-inf (a filtered token) never wins over a finite score; an all -inf row
    gives token 0 and NaN wins, the lowest NaN first, as torch.argmax."""
    g = torch.Generator().manual_seed(0)
    vocab = 5000
    logits = torch.randn(5, vocab, generator=g)
    logits[0, :] = float("-inf")
    logits[0, [7, 4321]] = 0.0  # the race among the two kept tokens
    logits[1, :] = float("-inf")
    logits[2, [100, 3000]] = float("nan")
    logits[3, :4999] = float("-inf")  # only the last token is left
    seeds, offsets = keys(5, g)
    got = ops.gumbel_argmax(logits, seeds, offsets)
    assert torch.equal(got, ops.gumbel_argmax_reference(logits, seeds, offsets))
    assert got[0] in (7, 4321) and got[1] == 0 and got[2] == 100 and got[3] == 4999


def test_same_key_same_token_any_batch():
    """A row's token depends on its logits, seed and offset only."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(9, 777, generator=g)
    seeds, offsets = keys(9, g)
    whole = ops.gumbel_argmax(logits, seeds, offsets)
    for r in (0, 4, 8):
        assert ops.gumbel_argmax(logits[r:r + 1], seeds[r:r + 1], offsets[r:r + 1]).item() == whole[r]


def test_draws_follow_the_softmax():
    """20,000 draws over 8 tokens (distinct offsets) against softmax(logits):
    chi-square under chi2.isf(1e-4, 7) (the keys are fixed: deterministic)."""
    n = 20000
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, 0.3]]).expand(n, 8).contiguous()
    tokens = ops.gumbel_argmax(logits, torch.full((n,), 99), torch.arange(n))
    expected = torch.softmax(logits[0].double(), dim=-1) * n
    counts = torch.bincount(tokens, minlength=8).double()
    assert float(((counts - expected) ** 2 / expected).sum()) < 29.88


def test_bad_arguments():
    logits, seeds, offsets = torch.randn(3, 10), torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64)
    with pytest.raises(TypeError, match="logits must be float32"):
        ops.gumbel_argmax(logits.double(), seeds, offsets)
    with pytest.raises(ValueError, match=r"logits must be \[num_rows, vocab_size\]"):
        ops.gumbel_argmax(logits[0], seeds, offsets)
    with pytest.raises(ValueError, match="seeds must be a 1-D tensor of num_rows = 3"):
        ops.gumbel_argmax(logits, seeds[:2], offsets)
    with pytest.raises(TypeError, match="offsets must be int64"):
        ops.gumbel_argmax(logits, seeds, offsets.int())
    with pytest.raises(ValueError, match="logits must be contiguous in its last dimension"):
        ops.gumbel_argmax(logits.t().contiguous().t(), seeds, offsets)


@pytest.mark.parametrize("vocab", [1, 3, 63, 64, 65, 4095, 4096, 4097, 49152])
@pytest.mark.parametrize("rows", [1, 2, 17])
def test_greedy_equals_torch_argmax(rows, vocab):
    """Ties (values repeated across the row and across work items of 4096),
    NaN, -inf and -0.0 against +0.0 go as torch.argmax's."""
    g = torch.Generator().manual_seed(rows * 7 + vocab)
    logits = strided_rows(rows, vocab, torch.float32, "cpu")
    logits.copy_(torch.randint(-3, 4, (rows, vocab), generator=g).float())  # many ties
    if rows > 1:
        logits[1] = float("-inf")
        logits[1, vocab // 2] = -0.0
        logits[1, -1] = 0.0  # equal to -0.0: the lower index wins
    if rows > 2:
        logits[2, vocab - 1] = float("nan")
    out = torch.full((rows,), -1, dtype=torch.int64)
    got = ops.greedy_argmax(logits, out=out)
    assert got is out
    assert torch.equal(got, logits.argmax(dim=-1))


def test_greedy_bad_arguments():
    with pytest.raises(TypeError, match="logits must be float32"):
        ops.greedy_argmax(torch.randn(3, 10).double())
    with pytest.raises(ValueError, match="out must be a 1-D tensor of num_rows = 3"):
        ops.greedy_argmax(torch.randn(3, 10), out=torch.empty(2, dtype=torch.int64))
