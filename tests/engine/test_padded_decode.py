"""Decode steps padded to CUDA-graph batch sizes -- the inputs the GPU
runner's graphs replay on -- run eagerly on the CPU: the same greedy tokens as
unpadded steps and as Hugging Face, while the batch shrinks as requests finish
(so it pads to several sizes), with sampled logprobs unchanged -- also with
async scheduling, whose decode inputs are filled from the previous step's
samples into the padded buffers. The LM head pads its rows to the same sizes,
prefill steps' too."""

import pytest
from checkpoints import hf_greedy

from pagoda import LLM, SamplingParams
from pagoda.worker.cuda_graph_runner import cudagraph_batch_sizes

PROMPTS = [[5, 9, 200, 17], [1], list(range(33, 50)), [250, 3], [7] * 30, [100, 101, 102], list(range(60, 100))]
# Different lengths: 7 running requests pad to 8, then 4, 2 and 1 as they finish.
PARAMS = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=2) for n in (3, 14, 6, 9, 12, 1, 5)]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("family", ["llama", "opt"])
def test_padded_decode_equals_unpadded(family, async_scheduling, make_checkpoint):
    model, folder = make_checkpoint(family)
    plain = LLM(folder, dtype="float32", device="cpu", kv_cache_space=0.05)
    padded = LLM(folder, dtype="float32", device="cpu", kv_cache_space=0.05, async_scheduling=async_scheduling)
    runner = padded.llm_engine.runner
    assert runner.cudagraph_batch_sizes == [] and runner.graph_runner is None  # the CPU never pads by itself
    runner.cudagraph_batch_sizes = cudagraph_batch_sizes(8)
    assert runner.cudagraph_batch_sizes == [1, 2, 4, 8]
    prepare, padded_sizes = runner.input_buffers.prepare, []

    def recording(scheduled, block_tables=None, pad_to=None, previous=None):
        inputs = prepare(scheduled, block_tables, pad_to, previous)
        if pad_to is not None:
            padded_sizes.append((len(scheduled.scheduled), pad_to))
        return inputs

    runner.input_buffers.prepare = recording
    compute_logits, lm_head_rows = runner.model.compute_logits, []

    def recording_logits(hidden):
        lm_head_rows.append(hidden.shape[0])
        return compute_logits(hidden)

    runner.model.compute_logits = recording_logits
    want = plain.generate(PROMPTS, PARAMS, use_tqdm=False)
    got = padded.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert {size for _, size in padded_sizes} == {8, 4, 2, 1}
    # The LM head runs at graph sizes only, the first step's 7 prompts too.
    assert set(lm_head_rows) == {8, 4, 2, 1} and lm_head_rows[0] == 8
    assert any(n < size for n, size in padded_sizes), "no step had padding rows"
    for prompt, params, w, g in zip(PROMPTS, PARAMS, want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids == hf_greedy(model, prompt, params.max_tokens)
        for lw, lg in zip(w.outputs[0].logprobs, g.outputs[0].logprobs):
            assert lw.keys() == lg.keys()
            for token in lw:
                assert lg[token].logprob == pytest.approx(lw[token].logprob, abs=1e-4)
    kv = padded.llm_engine.kv_cache_manager
    assert kv.num_free_blocks == runner.num_blocks, "KV blocks leaked"
