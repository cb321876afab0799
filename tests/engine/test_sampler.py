import math

import pytest
import torch

from pagoda.model_executor.layers.sampler import (
    Sampler, SamplingMetadata, apply_logit_bias, apply_penalties, compute_prompt_logprobs, make_generator)
from pagoda.sampling_params import SamplingParams

V = 64


def run(logits, params, outputs=None, prompts=None, generators=None, eos=()):
    outputs = outputs if outputs is not None else [[] for _ in params]
    md = SamplingMetadata.from_requests(params, outputs, prompt_token_ids=prompts, generators=generators,
                                        eos_token_ids=eos)
    return Sampler()(logits, md)


def draws(logits_row, params, n=4000):
    """Sampled tokens of n identical rows (one batched call)."""
    out = run(logits_row.expand(n, -1).clone(), [params] * n)
    return set(out.sampled_token_ids)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def test_greedy_is_argmax_and_does_not_touch_input():
    logits = torch.randn(8, V)
    before = logits.clone()
    out = run(logits, [SamplingParams(temperature=0.0)] * 8)
    assert out.sampled_token_ids == logits.argmax(-1).tolist()
    assert out.logprobs is None
    assert torch.equal(logits, before)


def test_mixed_greedy_and_random_rows():
    logits = torch.randn(6, V) * 3
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 1.0) for i in range(6)]
    out = run(logits, params)
    for i in range(0, 6, 2):
        assert out.sampled_token_ids[i] == logits[i].argmax().item()


def test_bf16_logits_accepted():
    logits = torch.randn(3, V).to(torch.bfloat16)
    out = run(logits, [SamplingParams(temperature=0.0)] * 3)
    assert out.sampled_token_ids == logits.float().argmax(-1).tolist()


def test_random_sampling_follows_the_distribution():
    logits = torch.tensor([0.0, 1.0, 2.0, -1.0])
    n = 40000
    out = run(logits.expand(n, -1).clone(), [SamplingParams()] * n)
    freq = torch.bincount(torch.tensor(out.sampled_token_ids), minlength=4).double() / n
    expected = torch.softmax(logits.double(), -1)
    assert torch.allclose(freq, expected, atol=0.01), (freq, expected)


def test_temperature_sharpens():
    logits = torch.tensor([0.0, 1.0, 2.0, -1.0])
    n = 20000
    out = run(logits.expand(n, -1).clone(), [SamplingParams(temperature=0.5)] * n)
    freq = torch.bincount(torch.tensor(out.sampled_token_ids), minlength=4).double() / n
    assert torch.allclose(freq, torch.softmax(logits.double() / 0.5, -1), atol=0.01)


def test_top_k_support():
    logits = torch.randn(V)
    allowed = set(logits.topk(5).indices.tolist())
    got = draws(logits, SamplingParams(top_k=5, temperature=2.0))
    assert got == allowed  # inside, and every allowed token shows up at this temperature


def _top_p_allowed(logits, index):
    """p halfway between two cumulative sums (no float ties at the boundary)
    and the set it keeps: the most likely tokens up to and including the one
    that reaches p."""
    probs = torch.softmax(logits.double(), -1)
    desc = probs.argsort(descending=True)
    cum = probs[desc].cumsum(0)
    p = float(cum[index - 1] + cum[index]) / 2
    return p, set(desc[: index + 1].tolist())


def test_top_p_support():
    logits = torch.randn(V)
    p, allowed = _top_p_allowed(logits, 4)
    got = draws(logits * 1.0, SamplingParams(top_p=p))
    assert got <= allowed and len(got) >= 3


def test_min_p_support():
    logits = torch.randn(V) * 2
    probs = torch.softmax(logits.double(), -1)
    ratios = (probs / probs.max()).sort(descending=True).values
    min_p = float(ratios[5] + ratios[6]) / 2  # keeps 6 tokens
    allowed = set((probs / probs.max() >= min_p).nonzero().flatten().tolist())
    assert len(allowed) == 6
    got = draws(logits, SamplingParams(min_p=min_p, temperature=1.0))
    assert got <= allowed and len(got) >= 4


def test_top_k_and_top_p_with_temperature():
    logits = torch.randn(V)
    t = 0.7
    scaled = logits / t
    topk = scaled.topk(10)
    # top_p over the renormalised top-k distribution
    masked = torch.full_like(scaled, float("-inf")).scatter(0, topk.indices, topk.values)
    p, allowed = _top_p_allowed(masked, 3)
    got = draws(logits, SamplingParams(temperature=t, top_k=10, top_p=p))
    assert got <= allowed


def test_per_row_parameters_in_one_batch():
    logits = torch.randn(V)
    n = 2000
    params = [SamplingParams(top_k=2), SamplingParams(top_k=0), SamplingParams(top_k=1, temperature=1.5)] * n
    out = run(logits.expand(len(params), -1).clone(), params).sampled_token_ids
    top2 = set(logits.topk(2).indices.tolist())
    assert set(out[0::3]) == top2
    assert len(set(out[1::3])) > 10
    assert set(out[2::3]) == {logits.argmax().item()}


def test_penalties_hand_computed():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    md = SamplingMetadata.from_requests([params], output_token_ids=[[3, 3, 4]], prompt_token_ids=[[0, 1]])
    apply_penalties(logits, md)
    # rep: seen {0,1,3,4}: 2/2=1, -1*2=-2, 3/2=1.5, -2*2=-4; then output counts 3:2, 4:1
    expected = [1.0, -2.0, 0.5, 1.5 - 0.5 - 2 * 0.25, -4.0 - 0.5 - 0.25, 1.0]
    assert logits[0].tolist() == pytest.approx(expected)


def test_penalties_per_row_and_greedy_effect():
    logits = torch.tensor([[1.0, 0.9, 0.0], [1.0, 0.9, 0.0]])
    params = [SamplingParams(temperature=0.0, frequency_penalty=1.0), SamplingParams(temperature=0.0)]
    out = run(logits, params, outputs=[[0], [0]], prompts=[[], []])
    assert out.sampled_token_ids == [1, 0]


def test_repetition_penalty_counts_prompt_tokens():
    logits = torch.tensor([[1.0, 0.9, 0.0]])
    out = run(logits, [SamplingParams(temperature=0.0, repetition_penalty=1.5)], outputs=[[]], prompts=[[0]])
    assert out.sampled_token_ids == [1]
    with pytest.raises(ValueError, match="prompt_token_ids"):
        SamplingMetadata.from_requests([SamplingParams(repetition_penalty=1.5)], [[]])


def test_logit_bias():
    logits = torch.zeros(2, 5)
    apply_logit_bias(logits, {0: {1: 2.5, 3: -1.0}, 1: {4: 0.5}})
    assert logits.tolist() == [[0, 2.5, 0, -1.0, 0], [0, 0, 0, 0, 0.5]]
    logits = torch.randn(3, V)
    params = [SamplingParams(temperature=0.0, logit_bias={7: 100.0}), SamplingParams(temperature=0.0),
              SamplingParams(logit_bias={9: 1000.0})]
    out = run(logits, params)
    assert out.sampled_token_ids == [7, logits[1].argmax().item(), 9]


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.zeros(3, 8)
    logits[:, 2] = 10.0  # EOS
    logits[:, 5] = 9.0  # a stop token id
    logits[:, 1] = 8.0
    p = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[5])
    out = run(logits, [p, p, p], outputs=[[], [4], [4, 4]], eos=[2])
    assert out.sampled_token_ids == [1, 1, 2]


def test_logprobs_are_raw_with_ranks():
    logits = torch.randn(4, V) * 3
    params = [SamplingParams(logprobs=3, temperature=0.5, top_k=5, presence_penalty=1.0),
              SamplingParams(temperature=0.0, logprobs=0),
              SamplingParams(),
              SamplingParams(logprobs=5, logit_bias={0: 50.0}, temperature=0.0)]
    out = run(logits, params, outputs=[[1, 2], [], [], []])
    ref = torch.log_softmax(logits, -1)
    assert out.logprobs[2] is None
    for i, k in [(0, 3), (1, 0), (3, 5)]:
        lp = out.logprobs[i]
        tok = out.sampled_token_ids[i]
        assert lp.token_ids[0] == tok and len(lp.token_ids) == k + 1 == len(lp.logprobs)
        assert lp.logprobs[0] == pytest.approx(ref[i, tok].item(), abs=1e-5)
        assert lp.rank == 1 + int((ref[i] > ref[i, tok]).sum())
        order = ref[i].argsort(descending=True)[:k].tolist()
        assert lp.token_ids[1:] == order
        assert lp.logprobs[1:] == pytest.approx(ref[i, order].tolist(), abs=1e-5)
    assert out.sampled_token_ids[3] == 0 and out.logprobs[3].rank == 1 + int((ref[3] > ref[3, 0]).sum())
    assert out.logprobs[1].rank == 1


def test_prompt_logprobs():
    logits = torch.randn(5, V)
    prompt = [3, 9, 1, 1, 60]
    res = compute_prompt_logprobs(logits, prompt, 2)
    ref = torch.log_softmax(logits, -1)
    assert len(res) == 4
    for i, r in enumerate(res):
        assert r.token_ids[0] == prompt[i + 1]
        assert r.logprobs[0] == pytest.approx(ref[i, prompt[i + 1]].item(), abs=1e-5)
        assert r.token_ids[1:] == ref[i].topk(2).indices.tolist()
    with pytest.raises(ValueError):
        compute_prompt_logprobs(logits, prompt[:3], 2)


def _generate(seed_rows, others, steps, seed_pos, logits_fn):
    """Run `steps` steps of a batch holding the seeded request at seed_pos."""
    gen = make_generator(1234)
    tokens = []
    for step in range(steps):
        rows = list(others)
        rows.insert(seed_pos, seed_rows)
        logits = torch.stack([logits_fn(step, r) for r in range(len(rows))])
        logits[seed_pos] = logits_fn(step, "seeded")
        gens = [None] * len(rows)
        gens[seed_pos] = gen
        out = run(logits, rows, generators=gens)
        tokens.append(out.sampled_token_ids[seed_pos])
    return tokens, gen.get_state()


def _logits_fn(step, row):
    g = torch.Generator().manual_seed(hash((step, str(row))) % (2**31))
    return torch.randn(V, generator=g)


def test_seeded_rows_reproducible_across_batches():
    seeded = SamplingParams(seed=1234, top_p=0.95)
    a, sa = _generate(seeded, [], 12, 0, _logits_fn)
    b, sb = _generate(seeded, [SamplingParams(), SamplingParams(top_k=3), SamplingParams(temperature=0.0)],
                      12, 2, _logits_fn)
    c, sc = _generate(seeded, [SamplingParams(seed=5), SamplingParams(min_p=0.1)], 12, 0, _logits_fn)
    assert a == b == c
    assert torch.equal(sa, sb) and torch.equal(sa, sc)  # the generator advanced the same amount


def test_seeded_stream_is_keyed_by_output_count():
    """A seeded row's noise is keyed by its seed and the number of tokens it
    has generated, not by the generator's state: a stream resumed at any
    point continues identically, and the generator is never consumed."""
    logits = torch.zeros(1, V)
    gen = make_generator(7)
    state = gen.get_state()
    first = [run(logits, [SamplingParams()], outputs=[[0] * k], generators=[gen]).sampled_token_ids[0]
             for k in range(8)]
    assert torch.equal(gen.get_state(), state)
    again = make_generator(7)
    backwards = [run(logits, [SamplingParams()], outputs=[[0] * k], generators=[again]).sampled_token_ids[0]
                 for k in reversed(range(8))]
    assert backwards == first[::-1]
    assert len(set(first)) > 1  # the count moves the stream


def test_greedy_rows_do_not_consume_their_generator():
    gen = make_generator(3)
    state = gen.get_state()
    run(torch.randn(2, V), [SamplingParams(temperature=0.0, seed=3), SamplingParams()], generators=[gen, None])
    assert torch.equal(gen.get_state(), state)


def test_n_rows_with_independent_seeds():
    """n>1 is n rows; each has its own generator (e.g. seed, seed+1, ...)."""
    logits = torch.zeros(3, 1000)
    p = SamplingParams(seed=11)
    gens = [make_generator(11), make_generator(12), make_generator(11)]
    outs = [run(logits, [p] * 3, generators=gens).sampled_token_ids for _ in range(5)]
    col = list(zip(*outs))
    assert col[0] == col[2] and col[0] != col[1]


def test_unseeded_shared_generator():
    logits = torch.randn(4, V)
    params = [SamplingParams()] * 4
    md1 = SamplingMetadata.from_requests(params, [[]] * 4, generator=make_generator(9))
    md2 = SamplingMetadata.from_requests(params, [[]] * 4, generator=make_generator(9))
    assert Sampler()(logits, md1).sampled_token_ids == Sampler()(logits, md2).sampled_token_ids


def test_masked_tokens_never_sampled_with_extreme_values():
    logits = torch.full((1000, V), -1e30)
    logits[:, 3] = 0.0
    logits[:, 4] = -1.0
    out = run(logits, [SamplingParams(top_k=1)] * 1000)
    assert set(out.sampled_token_ids) == {3}
    assert not math.isnan(run(logits, [SamplingParams(logprobs=2)] * 1000).logprobs[0].logprobs[0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("edit", [False, True])
def test_gpu_sampling_copies_the_logits_only_to_edit_them(edit, dtype):
    """On CUDA the sampling kernel only reads the logits, in the model's
    dtype as the LM head gives them: without an edit (here a logit bias) they
    are neither copied nor widened (the step's largest tensor) nor changed,
    and the tokens are those of the widened logits; with one, a float32 copy
    takes the edit and the input stays."""
    from pagoda import _native

    if not _native.has_kernel("sample"):
        pytest.skip("needs Pagoda's CUDA sampling kernel")
    logits = torch.randn(64, 50_000, device="cuda").to(dtype)
    before = logits.clone()
    params = [SamplingParams(temperature=0.8, top_p=0.9, logit_bias={7: 100.0} if edit else None)] * 64
    md = SamplingMetadata.from_requests(params, [[] for _ in params], generator=make_generator(9))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    out = Sampler().sample(logits, md).to_host()
    extra = torch.cuda.max_memory_allocated() - start
    copied = extra >= logits.numel() * logits.element_size()
    assert copied == edit, extra
    assert torch.equal(logits, before)
    assert len(out.sampled_token_ids) == 64 and (not edit or set(out.sampled_token_ids) == {7})
    md = SamplingMetadata.from_requests(params, [[] for _ in params], generator=make_generator(9))
    widened = Sampler().sample(logits.float(), md)
    assert out.sampled_token_ids == widened.to_host().sampled_token_ids
