"""Piecewise CUDA graphs: steps with prefill in them (fresh prompts beside
decodes, chunked prefill, prefix-cache hits) of up to
max_cudagraph_capture_size tokens replay the model's pieces with attention
eager between them, and give what the same steps give eagerly; larger steps
run eagerly."""

import pytest
import torch
from recording import record_calls

from pagoda import LLM, SamplingParams
from pagoda.worker.cuda_graph_runner import piecewise_token_sizes

# Seven requests through max_num_seqs=3: requests join as others finish, so
# most prefills share their step with decodes.
PROMPTS = [[5, 9, 200, 17], [1], list(range(33, 50)), [250, 3], [7] * 30, [100, 101, 102], list(range(60, 100))]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=3) for n in (3, 24, 6, 9, 16, 1, 5)]


def test_ladder():
    assert piecewise_token_sizes(16) == [16]
    assert piecewise_token_sizes(20) == [16, 20]
    sizes = piecewise_token_sizes(512)
    assert sizes[:8] == list(range(16, 129, 16)) and sizes[-1] == 512 and len(sizes) == 16
    assert all(b - a <= max(16, a // 4) for a, b in zip(sizes, sizes[1:]))


def count_piecewise(runner):
    return record_calls(runner.graph_runner, "replay_pieces")


@pytest.fixture(autouse=True)
def _fp32(request, fp32_supported):
    if fp32_supported is not True and "bfloat16" not in request.node.name:
        pytest.skip(f"the CUDA attention kernels take no float32: {fp32_supported}")


def engines(folder, **kwargs):
    kwargs = dict(dtype="float32", skip_tokenizer_init=True, multiprocess=False, max_num_seqs=3, **kwargs)
    return LLM(folder, **kwargs), LLM(folder, enforce_eager=True, **kwargs)


def assert_same_outputs(got, want):
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for lg, lw in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            assert lg.keys() == lw.keys()
            for token in lw:
                # Padded rows change the GEMMs' shapes, so their rounding may differ.
                assert lg[token].logprob == pytest.approx(lw[token].logprob, abs=1e-4)


@pytest.mark.parametrize("family", ["llama", "qwen3", "opt"])
def test_mixed_steps_replay_pieces(family, reference):
    ref = reference(family)
    graphs, eager = engines(ref.folder)
    runner = graphs.llm_engine.runner
    pieces, between = runner.graph_runner.piecewise[16]
    layers = len(runner.attention_layers)
    assert len(pieces) == layers + 1 and len(between) == layers
    steps = count_piecewise(runner)
    model_calls = []
    runner.model.register_forward_pre_hook(lambda *_: model_calls.append(1))
    got = graphs.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert model_calls == [], "a step ran the model eagerly"
    assert len(steps) >= 4 and any(n % 16 for n in steps), steps
    assert_same_outputs(got, eager.generate(PROMPTS, PARAMS, use_tqdm=False))
    for prompt, output in zip(PROMPTS, got):
        ref.check_greedy(prompt, output, "float32")
    kv = graphs.llm_engine.kv_cache_manager
    assert kv.num_free_blocks == runner.num_blocks, "KV blocks leaked"


def test_chunks_and_prefix_hits_replay_pieces(reference):
    """Chunked prefill (12-token budget) and cached prefixes: prefill rows
    that attend over pages written by earlier steps."""
    ref = reference("llama")
    prefix = list(range(200, 240))
    prompts = [prefix + [1, 2], prefix + [3], prefix + list(range(5, 25)), [9] * 50]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=2) for n in (8, 5, 3, 6)]
    graphs, eager = engines(ref.folder, max_num_batched_tokens=12)
    steps = count_piecewise(graphs.llm_engine.runner)
    got = graphs.generate(prompts, params, use_tqdm=False)
    assert steps and max(steps) <= 12
    assert_same_outputs(got, eager.generate(prompts, params, use_tqdm=False))
    assert graphs.llm_engine.kv_cache_manager.prefix_cache_stats.hits > 0


def test_steps_over_the_largest_size_run_eagerly(reference):
    ref = reference("qwen3")
    graphs, eager = engines(ref.folder, max_cudagraph_capture_size=16)
    runner = graphs.llm_engine.runner
    assert sorted(runner.graph_runner.piecewise) == [16] and runner.cudagraph_batch_sizes == [1, 2, 3]
    steps = count_piecewise(runner)
    model_calls = []
    runner.model.register_forward_pre_hook(lambda *_: model_calls.append(1))
    got = graphs.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert steps and max(steps) <= 16
    assert model_calls, "the 40-token prompt's step should have run eagerly"
    assert_same_outputs(got, eager.generate(PROMPTS, PARAMS, use_tqdm=False))


def test_bfloat16_flash_prefill_through_pieces(reference):
    """bf16 takes torch's flash kernel for the prefills (fp32 takes Triton's)."""
    ref = reference("qwen3")
    graphs = LLM(ref.folder, dtype="bfloat16", skip_tokenizer_init=True, multiprocess=False, max_num_seqs=3)
    steps = count_piecewise(graphs.llm_engine.runner)
    got = graphs.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert steps
    for prompt, output in zip(PROMPTS, got):
        ref.check_greedy(prompt, output, "bfloat16")
    assert isinstance(graphs.llm_engine.runner.graph_runner.piecewise[16][0][0], torch.cuda.CUDAGraph)
