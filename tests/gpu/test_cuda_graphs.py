"""CUDA graphs of decode steps: captured for the whole ladder, replayed for
every pure decode step that fits, giving exactly what the same padded inputs
give eagerly (same kernels, same shapes), and close to unpadded eager steps."""

import pytest
import torch
from recording import record_calls

from pagoda import LLM, SamplingParams
from pagoda.worker.cuda_graph_runner import cudagraph_batch_sizes

PROMPTS = [[5, 9, 200, 17], [1], list(range(33, 50)), [250, 3], [7] * 30, [100, 101, 102], list(range(60, 100))]
# Different lengths: the running batch shrinks, so several graph sizes replay.
PARAMS = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=3) for n in (3, 24, 6, 9, 16, 1, 5)]


def test_ladder():
    assert cudagraph_batch_sizes(1) == [1]
    assert cudagraph_batch_sizes(3) == [1, 2, 3]
    assert cudagraph_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    sizes = cudagraph_batch_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256 and len(sizes) == 20
    assert all(b - a <= 16 for a, b in zip(sizes, sizes[1:]))


@pytest.mark.parametrize("family", ["llama", "qwen3", "opt"])
def test_graph_replay_equals_padded_eager(family, reference):
    ref = reference(family)
    graphs = LLM(ref.folder, dtype="bfloat16", skip_tokenizer_init=True, multiprocess=False, max_num_seqs=16)
    runner = graphs.llm_engine.runner
    assert runner.cudagraph_batch_sizes == [1, 2, 4, 8, 16] and set(runner.graph_runner.graphs) == {1, 2, 4, 8, 16}
    replays = record_calls(runner.graph_runner, "replay")
    # The same padded inputs, run eagerly.
    padded = LLM(ref.folder, dtype="bfloat16", skip_tokenizer_init=True, multiprocess=False, max_num_seqs=16, enforce_eager=True)
    padded.llm_engine.runner.cudagraph_batch_sizes = runner.cudagraph_batch_sizes
    plain = LLM(ref.folder, dtype="bfloat16", skip_tokenizer_init=True, multiprocess=False, max_num_seqs=16, enforce_eager=True)

    got = graphs.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert set(replays) == {8, 4, 2, 1}, "decode steps did not replay the graphs they fit"
    same_shapes = padded.generate(PROMPTS, PARAMS, use_tqdm=False)
    unpadded = plain.generate(PROMPTS, PARAMS, use_tqdm=False)
    for prompt, params, g, s, u in zip(PROMPTS, PARAMS, got, same_shapes, unpadded):
        assert g.outputs[0].token_ids == s.outputs[0].token_ids, f"prompt {prompt}"
        for lg, ls in zip(g.outputs[0].logprobs, s.outputs[0].logprobs):
            assert {t: p.logprob for t, p in lg.items()} == pytest.approx({t: p.logprob for t, p in ls.items()},
                                                                         abs=1e-5)
        # Unpadded eager matmuls may round differently (other shapes): compare
        # the tokens with the reference's tolerance instead.
        ref.check_greedy(prompt, g, "bfloat16")
        ref.check_greedy(prompt, u, "bfloat16")


def test_steps_that_do_not_fit_run_eagerly(reference):
    """max_num_batched_tokens caps the ladder (no decode batch can be larger);
    steps with prefill run eagerly and decode steps replay."""
    ref = reference("llama")
    llm = LLM(ref.folder, skip_tokenizer_init=True, multiprocess=False, max_num_seqs=8, max_num_batched_tokens=6)
    runner = llm.llm_engine.runner
    assert runner.cudagraph_batch_sizes == [1, 2, 4, 6]
    replays = record_calls(runner.graph_runner, "replay")
    outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert replays and max(replays) <= 6
    for prompt, output in zip(PROMPTS, outputs):
        ref.check_greedy(prompt, output, "bfloat16")


def test_graph_inputs_keep_their_addresses(reference):
    """What the graphs read is what each step writes: the persistent buffers."""
    llm = LLM(reference("qwen3").folder, skip_tokenizer_init=True, multiprocess=False, max_num_seqs=4)
    buffers = llm.llm_engine.runner.input_buffers
    before = [buffers.input_ids.gpu.data_ptr(), buffers.padded_block_tables.data_ptr()]
    llm.generate(PROMPTS[:3], PARAMS[:3], use_tqdm=False)
    assert [buffers.input_ids.gpu.data_ptr(), buffers.padded_block_tables.data_ptr()] == before
    assert buffers.host.is_pinned() and buffers.input_ids.gpu.device.type == "cuda"
    assert isinstance(llm.llm_engine.runner.graph_runner.graphs[4], torch.cuda.CUDAGraph)
