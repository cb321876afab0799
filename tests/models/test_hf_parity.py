"""Every model family against Hugging Face transformers on the same weights:
a batch of prompts of different lengths through the paged KV cache, prompt and
decode logits within fp32 (and bf16) tolerance, greedy tokens equal; also
chunked prefill mixed with decode, and prefix sharing."""

import copy

import pytest
import torch
import transformers
from checkpoints import CONFIGS, build_hf_model, save_checkpoint
from harness import PagedRunner, hf_greedy, run_schedule

from pagoda.model_executor.model_loader import get_model

PROMPTS = [[3, 17, 200, 5, 9], list(range(40, 51)), [7], [250, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]]
NUM_NEW = 4
FP32 = dict(rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module", params=list(CONFIGS))
def case(request, tmp_path_factory):
    """(name, HF model, checkpoint folder, greedy continuations, HF logits)."""
    hf = build_hf_model(request.param)
    folder = save_checkpoint(hf, str(tmp_path_factory.mktemp(request.param)))
    refs = [hf_greedy(hf, prompt, NUM_NEW) for prompt in PROMPTS]
    return request.param, hf, folder, [r[0] for r in refs], [r[1] for r in refs]


def load(folder, dtype):
    return get_model(folder, transformers.AutoConfig.from_pretrained(folder), dtype)


def sequences(greedy):
    """Each prompt plus what is fed back while decoding (all but the last new token)."""
    return [prompt + new[:-1] for prompt, new in zip(PROMPTS, greedy)]


def check_greedy(ours, greedy):
    for logits, prompt, new in zip(ours, PROMPTS, greedy):
        assert logits[len(prompt) - 1 :].argmax(-1).tolist() == new


def test_prefill_then_decode_fp32(case):
    name, _, folder, greedy, hf_logits = case
    model = load(folder, torch.float32)
    # One batched prefill of all prompts, then NUM_NEW - 1 batched decode steps.
    ours = run_schedule(PagedRunner(model, torch.float32), sequences(greedy), [len(p) for p in PROMPTS], [1] * 4)
    for got, want in zip(ours, hf_logits):
        torch.testing.assert_close(got, want, **FP32)
    check_greedy(ours, greedy)


def test_chunked_prefill_mixed_with_decode(case):
    _, _, folder, greedy, hf_logits = case
    model = load(folder, torch.float32)
    # Sequences 0 and 2 prefill at once and then decode while 1 and 3 prefill
    # in chunks of 3 and 4 tokens (crossing block boundaries mid-chunk).
    first, then = [len(PROMPTS[0]), 3, 1, 4], [1, 3, 1, 4]
    ours = run_schedule(PagedRunner(model, torch.float32, block_size=8), sequences(greedy), first, then)
    for got, want in zip(ours, hf_logits):
        torch.testing.assert_close(got, want, **FP32)


def test_bf16_close_to_fp32(case):
    """Our bf16 model strays from HF's fp32 logits no more than HF's own bf16
    model does (x2, plus a little). Greedy tokens are not compared: in bf16
    near-ties of a random model flip either way."""
    _, hf, folder, greedy, hf_logits = case
    seqs = sequences(greedy)
    runner = PagedRunner(load(folder, torch.bfloat16), torch.bfloat16)
    ours = run_schedule(runner, seqs, [len(p) for p in PROMPTS], [1] * 4)
    hf_bf16 = copy.deepcopy(hf).to(torch.bfloat16)  # .to() is in place: keep the fp32 one intact
    with torch.inference_mode():
        hf_bf16_logits = [hf_bf16(torch.tensor([s])).logits[0].float() for s in seqs]
    for got, hf_bf, want in zip(ours, hf_bf16_logits, hf_logits):
        assert got.dtype == torch.float32
        hf_err, our_err = (hf_bf - want).abs().max().item(), (got - want).abs().max().item()
        assert our_err <= 2 * hf_err + 0.02, f"bf16 error {our_err} vs Hugging Face's own {hf_err}"


def test_prefix_sharing(case):
    """A second sequence reuses the first's cached full blocks for a common
    prefix and computes only its own suffix."""
    _, hf, folder, _, _ = case
    model = load(folder, torch.float32)
    runner = PagedRunner(model, torch.float32, block_size=4)
    prefix = PROMPTS[3][:8]  # two full blocks
    runner.step({0: PROMPTS[3]})
    suffix = [99, 98, 97]
    skipped = runner.share_prefix(1, source=0, num_blocks=2)
    got = runner.step({1: suffix})[1]
    with torch.inference_mode():
        want = hf(torch.tensor([prefix + suffix])).logits[0, skipped:].float()
    torch.testing.assert_close(got, want, **FP32)
