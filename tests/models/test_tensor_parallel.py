"""Tensor parallelism on the CPU: ranks of a gloo process group (spawned
processes) build every model family with get_model and run it through the
paged KV cache; their logits must match the unsharded model's in this process
(which never initializes torch.distributed), for safetensors checkpoints and
for dummy weights. Also the divisibility rule, the collectives, and the lazy
safetensors slices a rank reads its shard through.

Each world size is one spawn running every case (process start-up and imports
dominate on a small CPU)."""

import os
import subprocess
import sys
import types

import pytest
import torch
import torch.multiprocessing as mp
import transformers
from checkpoints import CONFIGS, LLAMA_LIKE, random_hf_model, save_checkpoint
from harness import PagedRunner, run_schedule
from safetensors.torch import save_file

from pagoda.distributed import (
    destroy_model_parallel,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    init_distributed_environment,
    initialize_model_parallel,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
    verify_tensor_parallel,
)
from pagoda.model_executor.model_loader import get_model
from pagoda.model_executor.model_loader.safetensors_loader import safetensors_weights_iterator

# Sequences 0 and 1 prefill 4 and 2 tokens, then decode one token a step. Ids
# of both halves of the vocabulary (each rank's slice at TP=2).
SEQUENCES = [[3, 17, 200, 5, 9, 249], [7, 130, 2, 64]]
FIRST, THEN = [4, 2], [1, 1]
FP32 = dict(rtol=1e-5, atol=1e-5)

TP2_MODELS = {
    name: CONFIGS[name]
    for name in ("llama", "qwen2", "qwen3", "opt", "opt_project_post_norm", "llama_tied_bias_linear_rope")
}
# One KV head for two ranks (replicated), and a vocabulary that TP=2 pads.
TP2_MODELS["llama_mqa_padded_vocab"] = lambda: transformers.LlamaConfig(
    **dict(LLAMA_LIKE, num_key_value_heads=1, vocab_size=250)
)
# SmolLM2's head counts (9 query, 3 KV heads), tied: at TP=3 the padded
# vocabulary (384) leaves rank 2 padding rows only.
SMOLLM2_LIKE = lambda: transformers.LlamaConfig(  # noqa: E731
    **dict(LLAMA_LIKE, hidden_size=72, num_attention_heads=9, num_key_value_heads=3, intermediate_size=96),
    tie_word_embeddings=True,
)


def logits_of(model) -> list[torch.Tensor]:
    return run_schedule(PagedRunner(model, torch.float32), SEQUENCES, FIRST, THEN)


def run_jobs(jobs: dict) -> dict:
    """job key -> logits per sequence, or the ValueError's message."""
    results = {}
    for key, (folder, config, load_format) in jobs.items():
        try:
            results[key] = logits_of(get_model(folder, config, torch.float32, load_format=load_format))
        except ValueError as e:
            results[key] = str(e)
    return results


def _rank_main(rank: int, world_size: int, init_method: str, jobs: dict, out_dir: str) -> None:
    torch.set_num_threads(1)  # the ranks share a small CPU
    init_distributed_environment(world_size, rank, init_method, "gloo")
    initialize_model_parallel(world_size)
    try:
        x = torch.arange(6.0).view(2, 3) + 10 * rank
        collectives = {
            "rank": get_tensor_model_parallel_rank(),
            "world_size": get_tensor_model_parallel_world_size(),
            "all_reduce": tensor_model_parallel_all_reduce(x.clone()),
            **{f"all_gather_{dim}": tensor_model_parallel_all_gather(x, dim) for dim in (0, 1, -1)},
        }
        torch.save(dict(run_jobs(jobs), collectives=collectives), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        destroy_model_parallel()


def run_ranks(world_size: int, jobs: dict, tmp_path) -> list[dict]:
    out_dir = tmp_path / f"tp{world_size}"
    out_dir.mkdir()
    init_method = f"file://{out_dir / 'rendezvous'}"
    mp.spawn(_rank_main, args=(world_size, init_method, jobs, str(out_dir)), nprocs=world_size)
    return [torch.load(out_dir / f"rank{rank}.pt") for rank in range(world_size)]


def make_jobs(models: dict, tmp_path) -> dict:
    """(model, load format) -> (folder, config, load format), with a random
    safetensors checkpoint of each model."""
    jobs = {}
    for name, make_config in models.items():
        hf = random_hf_model(make_config())
        folder = save_checkpoint(hf, str(tmp_path / name))
        config = transformers.AutoConfig.from_pretrained(folder)
        jobs[name, "safetensors"] = (folder, config, "safetensors")
        jobs[name, "dummy"] = ("unused", config, "dummy")
    return jobs


def check_against_tp1(ranks: list[dict], jobs: dict) -> None:
    want = run_jobs(jobs)
    for key, expected in want.items():
        assert not isinstance(expected, str), (key, expected)
        for rank, results in enumerate(ranks):
            assert not isinstance(results[key], str), (key, rank, results[key])
            for got, ref in zip(results[key], expected):
                assert got.shape == ref.shape, key  # exactly vocab_size wide: the padding is cut off
                torch.testing.assert_close(got, ref, **FP32, msg=lambda m: f"{key}, rank {rank}: {m}")
            # Every rank holds the same logits (so they sample alike).
            for got, rank0 in zip(results[key], ranks[0][key]):
                assert torch.equal(got, rank0), (key, rank)


def test_tp2_every_family_matches_tp1(tmp_path):
    jobs = make_jobs(TP2_MODELS, tmp_path)
    nine_heads = SMOLLM2_LIKE()
    ranks = run_ranks(2, dict(jobs, nine_heads=("unused", nine_heads, "dummy")), tmp_path)
    check_against_tp1(ranks, jobs)
    for rank, results in enumerate(ranks):
        assert results["nine_heads"] == "num_attention_heads (9) is not divisible by tensor_parallel_size (2)"
        collectives = results["collectives"]
        assert (collectives["rank"], collectives["world_size"]) == (rank, 2)
        x0, x1 = torch.arange(6.0).view(2, 3), torch.arange(6.0).view(2, 3) + 10
        assert torch.equal(collectives["all_reduce"], x0 + x1)
        assert torch.equal(collectives["all_gather_0"], torch.cat([x0, x1], 0))
        assert torch.equal(collectives["all_gather_1"], torch.cat([x0, x1], 1))
        assert torch.equal(collectives["all_gather_-1"], torch.cat([x0, x1], 1))


def test_tp3_nine_heads_matches_tp1(tmp_path):
    jobs = make_jobs({"smollm2_like": SMOLLM2_LIKE}, tmp_path)
    check_against_tp1(run_ranks(3, jobs, tmp_path), jobs)


def test_single_device_needs_no_torch_distributed():
    assert not torch.distributed.is_initialized()
    assert (get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()) == (1, 0)
    x = torch.randn(2, 3)
    assert tensor_model_parallel_all_reduce(x) is x and tensor_model_parallel_all_gather(x) is x
    destroy_model_parallel()  # nothing to destroy: a no-op
    with pytest.raises(RuntimeError, match="init_distributed_environment"):
        initialize_model_parallel(2)


def _config(**fields):
    return types.SimpleNamespace(**dict(dict(num_attention_heads=8, hidden_size=64, intermediate_size=128), **fields))


@pytest.mark.parametrize(
    "fields, tp, error",
    [
        (dict(), 8, None),
        (dict(num_key_value_heads=2), 4, None),  # KV heads split
        (dict(num_key_value_heads=1), 8, None),  # KV head replicated
        (dict(num_key_value_heads=2, intermediate_size=None, ffn_dim=96), 2, None),  # OPT's name
        (dict(num_attention_heads=9, num_key_value_heads=3), 2, r"num_attention_heads \(9\) .* \(2\)"),
        (dict(num_attention_heads=12, num_key_value_heads=4), 6, r"num_key_value_heads \(4\) .* \(6\)"),
        (dict(num_attention_heads=12, num_key_value_heads=6), 4, r"num_key_value_heads \(6\) .* \(4\)"),
        (dict(intermediate_size=100), 8, r"intermediate_size \(100\) .* \(8\)"),
        (dict(intermediate_size=None, ffn_dim=100), 8, r"ffn_dim \(100\) .* \(8\)"),
        (dict(), 0, "positive integer"),
    ],
)
def test_verify_tensor_parallel(fields, tp, error):
    if error is None:
        verify_tensor_parallel(_config(**fields), tp)
    else:
        with pytest.raises(ValueError, match=error):
            verify_tensor_parallel(_config(**fields), tp)


def test_verify_tensor_parallel_imports_no_torch():
    code = "import sys, pagoda.distributed.utils; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))


def test_lazy_safetensors_slices(tmp_path):
    tensors = {"w": torch.randn(6, 8), "b": torch.randn(6), "ids": torch.arange(6)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    seen = set()
    for name, lazy in safetensors_weights_iterator([str(tmp_path / "model.safetensors")], torch.bfloat16):
        seen.add(name)
        full = tensors[name].to(torch.bfloat16) if name != "ids" else tensors[name]
        assert lazy.shape == full.shape and torch.equal(lazy.load(), full)
        assert torch.equal(lazy.narrow(0, 2, 3).load(), full[2:5])
        assert torch.equal(lazy.narrow(0, 4, 0).load(), full[4:4])
        if name == "w":
            assert torch.equal(lazy.narrow(1, 4, 4).narrow(0, 1, 2).narrow(1, 1, 2).load(), full[1:3, 5:7])
        with pytest.raises(ValueError, match="cannot narrow"):
            lazy.narrow(0, 5, 2)
    assert seen == set(tensors)
