"""pagoda::sample (GPU sampling) against the sampler's own filters and the
pure-torch reference of its random stream (ops.sample_reference).

The kernel tests need a CUDA GPU; the reference's stream (Philox known
answers, the distribution of its draws) and the CPU error run anywhere.
"""

import pytest
import torch

from pagoda import _native, ops
from pagoda.model_executor.layers.sampler import (
    Sampler,
    SamplingMetadata,
    apply_min_p,
    apply_top_k_top_p,
    make_generator,
)
from pagoda.sampling_params import SamplingParams

HAS_CUDA_SAMPLE = torch.cuda.is_available() and _native.has_kernel("sample")
needs_cuda = pytest.mark.skipif(not HAS_CUDA_SAMPLE, reason="needs a CUDA GPU and the CUDA build of pagoda::sample")
# The distribution checks run the reference on the CPU and, where it exists, the kernel.
DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA_SAMPLE else [])


def draw(device, logits, temperature, seeds, offsets, top_k=None, top_p=None, min_p=None):
    """The kernel on CUDA (into an output poisoned with -1), the reference on the CPU."""
    args = [t if t is None else t.to(device) for t in (logits, temperature, seeds, offsets, top_k, top_p, min_p)]
    if device == "cpu":
        return ops.sample_reference(*args)
    out = torch.full((logits.shape[0],), -1, dtype=torch.int64, device=device)
    got = ops.sample(*args[:4], top_k=args[4], top_p=args[5], min_p=args[6], out=out)
    assert got is out
    return got


def kept_mask(logits, temperature, top_k=None, top_p=None, min_p=None):
    """[N, V] bool: the tokens Sampler's filters keep, plus any token tied with
    a kept one (the kernel keeps those, the sort an arbitrary subset); greedy
    rows: the argmax."""
    greedy = temperature == 0
    scaled = logits.float() / torch.where(greedy, 1.0, temperature)[:, None]
    filtered = scaled.clone()
    if min_p is not None:
        apply_min_p(filtered, min_p)
    if top_k is not None or top_p is not None:
        apply_top_k_top_p(filtered, top_k, top_p)
    keep = torch.isfinite(filtered)
    keep |= scaled >= torch.where(keep, scaled, float("inf")).amin(dim=-1, keepdim=True)
    argmax = torch.zeros_like(keep).scatter_(1, logits.float().argmax(-1, keepdim=True), True)
    return torch.where(greedy[:, None], argmax, keep)


def random_knobs(n, vocab, generator):
    """Per-row temperature (some greedy), top_k, top_p and min_p, each off in some rows."""

    def pick(choices):
        return torch.tensor(choices)[torch.randint(len(choices), (n,), generator=generator)]

    return dict(
        temperature=pick([0.0, 0.3, 0.7, 1.0, 1.5]),
        top_k=pick([0, 0, 1, 2, 5, 50, vocab, vocab + 3]).long(),
        top_p=pick([1.0, 1.0, 0.95, 0.8, 0.5, 0.1]),
        min_p=pick([0.0, 0.0, 0.01, 0.1, 0.5]),
    )


# --- the reference stream (anywhere) -----------------------------------------

# Random123's known-answer vectors for Philox4x32-10.
PHILOX_KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


@pytest.mark.parametrize("counter,key,want", PHILOX_KAT)
def test_philox_known_answers(counter, key, want):
    assert ops.philox4x32_10(torch.tensor(counter), torch.tensor(key)).tolist() == list(want)


def test_gumbel_noise_is_keyed_by_seed_offset_and_token():
    seeds = torch.tensor([7, 7, 8, -1])
    offsets = torch.tensor([0, 1, 0, 2**40])
    noise = ops.sample_gumbel(seeds, offsets, 37)
    assert noise.shape == (4, 37) and torch.isfinite(noise).all()
    assert torch.equal(ops.sample_gumbel(seeds[:1], offsets[:1], 37), noise[:1])  # no batch dependence
    assert torch.equal(ops.sample_gumbel(seeds[:1], offsets[:1], 10), noise[:1, :10])  # a prefix per vocab
    for a, b in [(0, 1), (0, 2), (0, 3)]:
        assert not torch.equal(noise[a], noise[b])


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    seen = expected > 0
    assert counts[~seen].sum() == 0, "a token outside the kept set was drawn"
    return float(((counts[seen] - expected[seen]) ** 2 / expected[seen]).sum())


# chi2.isf(1e-4, dof) for dof = 1..7: a correct sampler fails with probability
# 1e-4 per check (the seeds are fixed, so a run is deterministic).
CHI2_LIMIT = [15.14, 18.42, 21.11, 23.51, 25.74, 27.86, 29.88]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "knobs",
    [
        dict(temperature=1.0),
        dict(temperature=0.7),
        dict(temperature=1.3, top_k=3),
        dict(temperature=1.0, top_p=0.8),
        dict(temperature=1.0, min_p=0.2),
        dict(temperature=0.9, top_k=5, top_p=0.9, min_p=0.05),
    ],
)
@pytest.mark.parametrize("vary", ["seed", "offset"])
def test_draws_follow_the_filtered_softmax(device, knobs, vary):
    """20,000 draws over 8 tokens (one row each, distinct seeds or offsets)
    against softmax(filtered logits / T)."""
    n = 20000
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, 0.3]]).expand(n, 8).contiguous()
    per_row = {
        name: torch.full((n,), value, dtype=torch.int64 if name == "top_k" else torch.float32)
        for name, value in knobs.items()
    }
    seeds = torch.arange(n) if vary == "seed" else torch.full((n,), 1234)
    offsets = torch.zeros(n, dtype=torch.int64) if vary == "seed" else torch.arange(n)
    tokens = draw(device, logits, per_row.pop("temperature"), seeds, offsets, **per_row).cpu()
    scaled = logits[:1] / knobs["temperature"]
    if "min_p" in knobs:
        apply_min_p(scaled, torch.tensor([knobs["min_p"]]))
    if "top_k" in knobs or "top_p" in knobs:
        top_k = torch.tensor([knobs["top_k"]]) if "top_k" in knobs else None
        top_p = torch.tensor([knobs["top_p"]]) if "top_p" in knobs else None
        apply_top_k_top_p(scaled, top_k, top_p)
    probs = torch.softmax(scaled.double(), dim=-1)[0]
    counts = torch.bincount(tokens, minlength=8).double()
    dof = int((probs > 0).sum()) - 1
    if dof == 0:
        assert counts[probs > 0].item() == n
    else:
        assert chi_square(counts, probs) < CHI2_LIMIT[dof - 1]


def test_cpu_tensors_are_rejected():
    logits = torch.randn(2, 10)
    with pytest.raises(NotImplementedError, match="pagoda::sample has no CPU kernel: logits is on cpu"):
        ops.sample(logits, torch.ones(2), torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64))


def test_meta_tensors_trace_without_computing():
    meta = dict(device="meta")
    out = ops.sample(torch.empty(3, 100, **meta), torch.empty(3, **meta), torch.empty(3, dtype=torch.int64, **meta),
                     torch.empty(3, dtype=torch.int64, **meta))
    assert out.shape == (3,) and out.dtype == torch.int64


# --- the kernel (CUDA) ------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_rows_are_the_argmax(dtype):
    logits = torch.randn(64, 5000, device="cuda").to(dtype)
    logits[3, [10, 4000]] = 100.0  # a tie: the lower index, as torch.argmax
    logits[4, 77] = float("nan")  # NaN counts as the largest, as torch.argmax
    n = logits.shape[0]
    got = draw("cuda", logits, torch.zeros(n), torch.arange(n), torch.zeros(n, dtype=torch.int64))
    assert torch.equal(got, logits.float().argmax(-1))
    assert got[3] == 10 and got[4] == 77


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [1, 8, 1000, 50257, 151936])
def test_mixed_knobs_keep_the_reference_set_and_stream(dtype, vocab):
    """Random rows, each with its own temperature/top_k/top_p/min_p: every
    token lies in the set Sampler's filters keep and, where no ties blur that
    set (fp32 logits), equals the torch reference of the same stream."""
    g = torch.Generator().manual_seed(vocab)
    n = 300 if vocab < 100000 else 64
    logits = (torch.randn(n, vocab, generator=g) * 3).to(dtype)
    knobs = random_knobs(n, vocab, g)
    seeds = torch.randint(-(2**62), 2**62, (n,), generator=g)
    offsets = torch.randint(0, 5000, (n,), generator=g)
    got = draw("cuda", logits, knobs["temperature"], seeds, offsets, knobs["top_k"], knobs["top_p"], knobs["min_p"])
    keep = kept_mask(logits, knobs["temperature"], knobs["top_k"], knobs["top_p"], knobs["min_p"])
    assert keep[torch.arange(n), got.cpu()].all()
    if dtype == torch.float32:
        want = ops.sample_reference(*(t.cuda() for t in (logits, knobs["temperature"], seeds, offsets)),
                                    *(knobs[k].cuda() for k in ("top_k", "top_p", "min_p")))
        assert torch.equal(got, want)


@needs_cuda
@pytest.mark.parametrize(
    "vocab,row_stride",
    [
        (3000, 3000),  # 16-byte accesses
        (3001, 3004),  # 16-byte accesses and a tail of one token
        (3001, 3006),  # rows not 16-byte aligned: one token per access
    ],
)
def test_row_layouts_and_filters_off(vocab, row_stride):
    """Every access path gives the reference's tokens; None turns the filters off."""
    g = torch.Generator().manual_seed(0)
    n = 50
    logits = torch.randn(n, row_stride, generator=g).cuda()[:, :vocab]
    args = (torch.full((n,), 0.8), torch.arange(n), torch.full((n,), 3, dtype=torch.int64))
    got = draw("cuda", logits, *args)
    assert torch.equal(got, ops.sample_reference(logits, *(t.cuda() for t in args)))
    assert torch.equal(draw("cuda", logits[:1], *(t[:1] for t in args)), got[:1])  # one row: any stride


@needs_cuda
def test_seed_and_offset_fix_the_token_in_any_batch():
    g = torch.Generator().manual_seed(1)
    vocab = 32000
    row = torch.randn(1, vocab, generator=g)
    knobs = dict(temperature=torch.tensor([1.0]), top_k=torch.tensor([40]), top_p=torch.tensor([0.9]),
                 min_p=torch.tensor([0.0]))
    alone = draw("cuda", row, knobs["temperature"], torch.tensor([42]), torch.tensor([7]),
                 knobs["top_k"], knobs["top_p"], knobs["min_p"])
    for n, position in [(2, 1), (17, 9), (64, 63)]:
        logits = torch.randn(n, vocab, generator=g)
        logits[position] = row[0]
        batch_knobs = random_knobs(n, vocab, g)
        for name, value in knobs.items():
            batch_knobs[name][position] = value
        seeds = torch.randint(0, 1000, (n,), generator=g)
        offsets = torch.randint(0, 1000, (n,), generator=g)
        seeds[position], offsets[position] = 42, 7
        got = draw("cuda", logits, batch_knobs["temperature"], seeds, offsets,
                   batch_knobs["top_k"], batch_knobs["top_p"], batch_knobs["min_p"])
        assert got[position] == alone[0]


@needs_cuda
def test_offsets_and_seeds_vary_the_token():
    n, vocab = 200, 16
    logits = torch.zeros(n, vocab)  # uniform: every token equally likely
    by_offset = draw("cuda", logits, torch.ones(n), torch.full((n,), 5), torch.arange(n))
    by_seed = draw("cuda", logits, torch.ones(n), torch.arange(n), torch.full((n,), 5, dtype=torch.int64))
    assert len(set(by_offset.tolist())) >= 12 and len(set(by_seed.tolist())) >= 12
    assert not torch.equal(by_offset, by_seed)


@needs_cuda
def test_masked_logits_are_never_drawn():
    """-inf logits (logit_bias / min_tokens masks) have probability 0."""
    n, vocab = 500, 100
    logits = torch.full((n, vocab), float("-inf"))
    logits[:, 37] = 0.0
    logits[:, 90] = -1.0
    got = draw("cuda", logits, torch.full((n,), 2.0), torch.arange(n), torch.zeros(n, dtype=torch.int64),
               top_p=torch.full((n,), 0.99))
    assert set(got.tolist()) <= {37, 90} and (got == 90).any()


@needs_cuda
def test_no_rows():
    out = ops.sample(torch.empty(0, 10, device="cuda"), torch.empty(0, device="cuda"),
                     torch.empty(0, dtype=torch.int64, device="cuda"), torch.empty(0, dtype=torch.int64, device="cuda"))
    assert out.shape == (0,)


def sample_args(num_rows=4, vocab=10, **changes):
    """Valid torch.ops.pagoda.sample arguments on CUDA, with some replaced."""
    args = dict(
        out_ids=torch.empty(num_rows, dtype=torch.int64),
        logits=torch.randn(num_rows, vocab),
        temperature=torch.ones(num_rows),
        top_k=None,
        top_p=None,
        min_p=None,
        seeds=torch.zeros(num_rows, dtype=torch.int64),
        offsets=torch.zeros(num_rows, dtype=torch.int64),
    )
    args = {name: None if t is None else t.cuda() for name, t in args.items()}
    return list(dict(args, **changes).values())


@needs_cuda
@pytest.mark.parametrize(
    "changes,error,message",
    [
        (dict(logits=torch.randn(4, 10).int()), TypeError, "logits must be float32, bfloat16 or float16"),
        (dict(logits=torch.randn(40)), ValueError, r"logits must be \[num_rows, vocab_size\]"),
        (dict(logits=torch.randn(4, 0)), ValueError, r"logits must be \[num_rows, vocab_size\]"),
        (dict(temperature=torch.ones(4, dtype=torch.float64)), TypeError, "temperature must be float32"),
        (dict(temperature=torch.ones(3)), ValueError, "temperature must be a 1-D tensor of num_rows = 4"),
        (dict(seeds=torch.zeros(4, dtype=torch.int32)), TypeError, "seeds must be int64"),
        (dict(offsets=torch.zeros(5, dtype=torch.int64)), ValueError, "offsets must be a 1-D tensor of num_rows"),
        (dict(top_k=torch.zeros(4, dtype=torch.int32)), TypeError, "top_k must be int64"),
        (dict(top_p=torch.ones(2)), ValueError, "top_p must be a 1-D tensor"),
        (dict(min_p=torch.zeros(4, 2)), ValueError, "min_p must be a 1-D tensor"),
        (dict(out_ids=torch.zeros(4, dtype=torch.int32)), TypeError, "out_ids must be int64"),
    ],
)
def test_bad_arguments(changes, error, message):
    with pytest.raises(error, match=message):
        torch.ops.pagoda.sample(*sample_args(**{name: t.cuda() for name, t in changes.items()}))


@needs_cuda
def test_arguments_on_another_device():
    with pytest.raises(ValueError, match="seeds is on cpu but logits is on cuda"):
        torch.ops.pagoda.sample(*sample_args(seeds=torch.zeros(4, dtype=torch.int64)))


@needs_cuda
def test_vocabulary_limit():
    with pytest.raises(ValueError, match="pagoda::sample takes at most 16777215"):
        torch.ops.pagoda.sample(*sample_args(num_rows=1, vocab=2**24))


@needs_cuda
def test_sampler_uses_the_kernel_with_request_seeds():
    """Sampler on CUDA logits: seeded rows draw from (their seed, tokens
    generated so far) whatever the batch; unseeded rows from
    SamplingMetadata.generator (reproducible with the same generator state)."""
    g = torch.Generator().manual_seed(3)
    vocab = 1000
    logits = torch.randn(4, vocab, generator=g).cuda()
    params = [SamplingParams(temperature=0.8, top_k=50, seed=11), SamplingParams(temperature=1.0, top_p=0.9),
              SamplingParams(temperature=0.0), SamplingParams(temperature=1.2, min_p=0.05, seed=12)]
    outputs = [[1, 2, 3], [], [5], [6] * 9]

    def sample(rows, generator_seed):
        md = SamplingMetadata.from_requests(
            [params[r] for r in rows], [outputs[r] for r in rows],
            generators=[make_generator(params[r].seed) if params[r].seed is not None else None for r in rows],
            device="cuda", generator=torch.Generator().manual_seed(generator_seed))
        return Sampler()(logits[rows], md).sampled_token_ids

    tokens = sample([0, 1, 2, 3], 0)
    assert tokens[2] == int(logits[2].argmax())
    assert sample([3, 0], 99) == [tokens[3], tokens[0]]  # seeded rows: another batch, same tokens
    assert sample([0, 1, 2, 3], 0) == tokens
    seeds = torch.tensor([11, 0, 0, 12])
    want = ops.sample_reference(logits, torch.tensor([0.8, 1.0, 0.0, 1.2]).cuda(), seeds.cuda(),
                                torch.tensor([3, 0, 1, 9]).cuda(), top_k=torch.tensor([50, 0, 0, 0]).cuda(),
                                top_p=torch.tensor([1.0, 0.9, 1.0, 1.0]).cuda(),
                                min_p=torch.tensor([0.0, 0.0, 0.0, 0.05]).cuda())
    assert [tokens[0], tokens[3]] == [int(want[0]), int(want[3])]
