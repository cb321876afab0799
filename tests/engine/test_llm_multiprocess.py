"""The offline LLM with its engine core in a process of its own
(multiprocess=True, the default on a GPU): the same outputs as the core in
process -- text, token ids, stop strings, n > 1, logprobs, seeded sampling --
bad requests fail alone, a core that dies ends generate() with an error
(no hang), and shutdown, dropping the LLM or the end of the interpreter
stops the process -- also for a script without an `if __name__ ==
"__main__":` guard, which the spawned core must not re-run."""

import gc
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from pagoda import LLM, SamplingParams
from pagoda.engine.core_client import EngineCoreDiedError

ENGINE_ARGS = dict(dtype="float32", device="cpu", kv_cache_space=0.05, max_num_seqs=4)
PROMPTS = ["héllo wörld, hello", "世界 你好", "The quick brown fox", "naïve café 🙂", "STOP here; ### end"]
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=["o", "é"]),  # ended by the front end
    SamplingParams(temperature=1.0, seed=7, n=2, max_tokens=12, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0.8, top_k=5, seed=3, max_tokens=20, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True, include_stop_str_in_output=True, stop=[" "]),
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory, hf_tokenizer):
    """A tiny random Llama whose vocabulary covers the test tokenizer's."""
    import transformers
    from checkpoints import LLAMA_LIKE, random_hf_model, save_checkpoint

    model = random_hf_model(transformers.LlamaConfig(**dict(LLAMA_LIKE, vocab_size=len(hf_tokenizer) + 8)))
    folder = str(tmp_path_factory.mktemp("llama-text"))
    save_checkpoint(model, folder)
    hf_tokenizer.save_pretrained(folder)
    return folder


def completions(outputs):
    return [[(c.text, c.token_ids, c.finish_reason, c.stop_reason, c.logprobs) for c in o.outputs] for o in outputs]


def test_outputs_equal_the_in_process_core(folder):
    want = LLM(folder, multiprocess=False, **ENGINE_ARGS).generate(PROMPTS, PARAMS, use_tqdm=False)
    llm = LLM(folder, multiprocess=True, **ENGINE_ARGS)
    try:
        pid = llm.llm_engine.core_pid
        assert pid is not None and pid != os.getpid()
        got = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        assert completions(got) == completions(want)
        assert [o.prompt_token_ids for o in got] == [o.prompt_token_ids for o in want]
        # The stop string cut the second prompt's completion before max_tokens.
        assert got[1].outputs[0].finish_reason == "stop" and len(got[1].outputs[0].token_ids) < 24
        # Again on the same core: request ids and the core's state carry over.
        assert completions(llm.generate(PROMPTS, PARAMS, use_tqdm=False)) == completions(want)
    finally:
        llm.shutdown()
    assert not _alive(pid)


def test_the_core_process_is_not_reachable_from_here(folder):
    llm = LLM(folder, multiprocess=True, **ENGINE_ARGS)
    try:
        with pytest.raises(RuntimeError, match="another process"):
            llm.llm_engine.scheduler
        # What the core's start-up decided reached the front end.
        assert llm.llm_engine.model_config.device.type == "cpu"
        assert llm.llm_engine.async_scheduling is False
    finally:
        llm.shutdown()


def test_a_bad_request_fails_alone(folder):
    llm = LLM(folder, multiprocess=True, **ENGINE_ARGS)
    try:
        with pytest.raises(ValueError, match="max_tokens"):
            llm.generate(["hello", "world"], [SamplingParams(max_tokens=4), SamplingParams(max_tokens=-1)],
                         use_tqdm=False)
        with pytest.raises(ValueError, match="vocabulary"):
            llm.generate([[10**6]], SamplingParams(max_tokens=4), use_tqdm=False)
        out = llm.generate(["hello"], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 5
    finally:
        llm.shutdown()


@pytest.mark.parametrize("multiprocess", [False, True])
def test_a_tokenizer_past_the_models_vocabulary_fails_the_request_alone(make_checkpoint, multiprocess):
    """make_checkpoint's model has 256 ids, its tokenizer 330: a text that
    encodes past 255 is refused up front, not an index error in a step."""
    llm = LLM(make_checkpoint("llama")[1], multiprocess=multiprocess, **ENGINE_ARGS)
    try:
        tokenizer = llm.get_tokenizer()
        text = next(t for t in PROMPTS if max(tokenizer.encode(t)) >= 256)
        with pytest.raises(ValueError, match="does not match the model"):
            llm.generate([text], SamplingParams(max_tokens=4), use_tqdm=False)
        fits = [[5, 6, 7]]
        assert len(llm.generate(fits, SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
                   .outputs[0].token_ids) == 3
    finally:
        llm.shutdown()


def test_the_core_starts_before_the_tokenizer_loads_and_gets_its_stop_ids(folder, monkeypatch):
    """The core process is spawned first (it imports and loads while the
    front end reads its tokenizer); the front end's stop ids reach it after:
    here the id the model emits first, which must end the sequence there."""
    import pagoda.engine.llm_engine as llm_engine

    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    first = LLM(folder, multiprocess=False, **ENGINE_ARGS).generate(
        ["hello"], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    cores_at_tokenizer_load = []
    real_load = llm_engine.load_tokenizer

    def load_tokenizer(model_config):
        cores_at_tokenizer_load.append([p.name for p in multiprocessing.active_children()])
        return real_load(model_config)

    monkeypatch.setattr(llm_engine, "load_tokenizer", load_tokenizer)
    monkeypatch.setattr(llm_engine, "eos_token_ids", lambda model_config, tokenizer: list(first.token_ids))
    llm = LLM(folder, multiprocess=True, **ENGINE_ARGS)
    try:
        assert cores_at_tokenizer_load == [["pagoda-engine-core"]]
        out = llm.generate(["hello"], greedy, use_tqdm=False)[0].outputs[0]
        assert out.token_ids == first.token_ids and out.finish_reason == "stop"
    finally:
        llm.shutdown()


def run_python(*args: str) -> subprocess.CompletedProcess:
    """A fresh interpreter on this one's import path, which must exit 0."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    run = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    return run


def test_the_core_starts_before_this_process_imports_torch(folder, tmp_path):
    """`from pagoda import LLM` imports no torch, and LLM(...) starts the core
    process before this one imports it (seconds each): the imports overlap."""
    script = tmp_path / "imports.py"
    script.write_text(textwrap.dedent(f"""
        import builtins, multiprocessing, sys
        cores_at_torch_import = []
        real_import = builtins.__import__

        def watch(name, *args, **kwargs):
            if name.split(".")[0] == "torch" and "torch" not in sys.modules and not cores_at_torch_import:
                cores_at_torch_import.append([p.name for p in multiprocessing.active_children()])
            return real_import(name, *args, **kwargs)

        builtins.__import__ = watch
        from pagoda import LLM, SamplingParams
        print("torch after import", "torch" in sys.modules)
        llm = LLM({folder!r}, multiprocess=True, **{ENGINE_ARGS!r})
        print("cores at torch import", cores_at_torch_import)
        out = llm.generate(["hello"], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)
        print("tokens", len(out[0].outputs[0].token_ids))
        llm.shutdown()
    """))
    run = run_python(str(script))
    assert "torch after import False" in run.stdout
    assert "cores at torch import [['pagoda-engine-core']]" in run.stdout
    assert "tokens 3" in run.stdout


def test_the_core_in_this_process_needs_no_process_channel(folder):
    """multiprocess=False steps the core through the engine's in-process
    client: ZeroMQ (the process channel's) is never imported, so a CPU
    user pays neither its import nor its memory."""
    script = (f"import sys; from pagoda import LLM, SamplingParams; llm = LLM({folder!r}, multiprocess=False, "
              f"**{ENGINE_ARGS!r}); out = llm.generate(['hi'], SamplingParams(max_tokens=2, ignore_eos=True), "
              "use_tqdm=False); print('tokens', len(out[0].outputs[0].token_ids), 'zmq', 'zmq' in sys.modules)")
    run = run_python("-c", script)
    assert "tokens 2 zmq False" in run.stdout


def test_cuda_insisted_on_without_a_gpu_fails_in_the_callers_terms(folder):
    """device="cuda" puts the core in its own process (guessed without
    torch); where there is no GPU its error comes back as a ValueError."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    args = dict(ENGINE_ARGS, device="cuda")
    with pytest.raises(ValueError, match="device='cuda' but torch .* sees no CUDA GPU"):
        LLM(folder, **args)
    assert [p.name for p in multiprocessing.active_children()] == []


def test_a_front_end_that_cannot_start_stops_the_core_it_started(folder, monkeypatch):
    import pagoda.engine.llm_engine as llm_engine

    def load_tokenizer(model_config):
        raise OSError("no tokenizer here")

    monkeypatch.setattr(llm_engine, "load_tokenizer", load_tokenizer)
    with pytest.raises(OSError, match="no tokenizer here"):
        LLM(folder, multiprocess=True, **ENGINE_ARGS)
    assert [p.name for p in multiprocessing.active_children()] == []


def test_a_dead_core_ends_generate_with_an_error(folder):
    llm = LLM(folder, multiprocess=True, **ENGINE_ARGS)
    pid = llm.llm_engine.core_pid
    llm.generate(["hello"], SamplingParams(max_tokens=2), use_tqdm=False)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(EngineCoreDiedError):
        llm.generate(["hello"] * 3, SamplingParams(max_tokens=2000, ignore_eos=True), use_tqdm=False)
    with pytest.raises(EngineCoreDiedError):  # at once, not a hang
        llm.generate(["hello"], SamplingParams(max_tokens=2), use_tqdm=False)
    llm.shutdown()


def test_reset_prefix_cache_reaches_the_core_process(folder):
    llm = LLM(folder, multiprocess=True, block_size=4, **ENGINE_ARGS)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompt = "The quick brown fox jumps over the lazy dog"
    try:
        first = llm.generate([prompt], params, use_tqdm=False)[0]
        assert llm.generate([prompt], params, use_tqdm=False)[0].num_cached_tokens > 0
        assert llm.reset_prefix_cache() is True
        again = llm.generate([prompt], params, use_tqdm=False)[0]
        assert again.num_cached_tokens == 0 and again.outputs[0].token_ids == first.outputs[0].token_ids
        with pytest.raises(ValueError, match="no utility method 'shutdown'"):  # only the listed methods
            llm.llm_engine.client.call_utility("shutdown")
        with pytest.raises(TypeError):  # a bad call fails alone; the core serves on
            llm.llm_engine.client.call_utility("reset_prefix_cache", 1)
        assert llm.generate([prompt], params, use_tqdm=False)[0].num_cached_tokens > 0
        os.kill(llm.llm_engine.core_pid, signal.SIGKILL)
        with pytest.raises(EngineCoreDiedError):  # no hang waiting for an answer
            llm.reset_prefix_cache()
    finally:
        llm.shutdown()


def test_dropping_the_llm_stops_its_core(folder):
    llm = LLM(folder, multiprocess=True, **ENGINE_ARGS)
    pid = llm.llm_engine.core_pid
    del llm
    gc.collect()
    assert not _alive(pid)


def test_an_unguarded_script_runs_and_leaves_no_process(folder, tmp_path):
    """LLM(...) at a script's top level, no main guard, no shutdown: the
    spawned core does not re-run the script, and it is gone at exit."""
    script = tmp_path / "offline.py"
    script.write_text(textwrap.dedent(f"""
        from pagoda import LLM, SamplingParams
        llm = LLM({folder!r}, multiprocess=True, **{ENGINE_ARGS!r})
        out = llm.generate(["hello"], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        print("tokens", len(out[0].outputs[0].token_ids), "core", llm.llm_engine.core_pid)
    """))
    run = run_python(str(script))
    line = next(line for line in run.stdout.splitlines() if line.startswith("tokens"))
    assert line.split()[1] == "4"
    assert not _alive(int(line.split()[3]))


def test_the_cpu_keeps_the_core_in_process(folder):
    llm = LLM(folder, **ENGINE_ARGS)
    assert llm.llm_engine.core_pid is None and llm.llm_engine.scheduler is not None
    with pytest.raises(ValueError, match="multiprocess"):
        LLM(folder, multiprocess="yes", **ENGINE_ARGS)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead too
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"
