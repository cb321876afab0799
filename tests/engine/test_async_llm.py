"""AsyncLLM end to end on a tiny random Llama (prompts as token ids): concurrent
streams equal LLM.generate, delta/cumulative/final-only outputs agree,
cancelling frees the KV blocks, an engine failure reaches every waiter, and
the event loop keeps running while the engine steps -- with the engine core
in a thread scheduling one step at a time and asynchronously (the GPU
default), and with the core in its own process (what the server runs).

pytest-asyncio is not installed: each test drives its coroutine with asyncio.run.
"""

import asyncio
import os
import signal
import time

import pytest

from pagoda import LLM, SamplingParams
from pagoda.engine.async_llm import AsyncLLM, EngineDeadError, RequestOutputKind

PROMPTS = [[5, 9, 200, 17], [1], list(range(30, 47)), [250, 3], [7] * 30, [100, 101, 102]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
ENGINE_ARGS = dict(dtype="float32", kv_cache_space=0.05, max_num_seqs=4)


@pytest.fixture(scope="module")
def folder(make_checkpoint):
    return make_checkpoint("llama")[1]


@pytest.fixture(scope="module")
def reference(folder):
    """Greedy token ids per prompt from the offline LLM."""
    outputs = LLM(folder, **ENGINE_ARGS).generate(PROMPTS, GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


MODES = {"sync": dict(async_scheduling=False), "async-scheduling": dict(async_scheduling=True),
         "process": dict(async_scheduling=False, multiprocess=True)}


def make(folder, mode):
    return AsyncLLM(folder, disable_log_stats=True, **MODES[mode], **ENGINE_ARGS)


@pytest.fixture(params=list(MODES))
def llm(folder, request):
    llm = make(folder, request.param)
    yield llm
    llm.shutdown()
    assert not llm.client.is_alive()


@pytest.fixture(params=["sync", "async-scheduling"])
def inproc_llm(folder, request):
    """The core in a thread of the test process, where tests can reach into it."""
    llm = make(folder, request.param)
    yield llm
    llm.shutdown()


def slow_down(llm, monkeypatch, seconds):
    """Each model step also sleeps (releasing the GIL, like a long kernel)."""
    execute = llm.engine.runner.execute

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return execute(*args, **kwargs)

    monkeypatch.setattr(llm.engine.runner, "execute", slow)


async def collect(llm, prompt, request_id, params=GREEDY, **kwargs):
    return [out async for out in llm.generate(prompt, params, request_id, **kwargs)]


async def wait_pool_full(llm, timeout=10.0):
    """The core frees blocks asynchronously: poll its stats until it did."""
    deadline = time.monotonic() + timeout
    while (stats := llm.scheduler_stats).num_used_blocks:
        assert time.monotonic() < deadline, f"KV blocks leaked: {stats.num_used_blocks} of {stats.num_blocks} in use"
        await asyncio.sleep(0.01)
    assert stats.num_blocks == llm.ready.num_blocks


def test_concurrent_streams_equal_offline_generate(llm, reference):
    async def main():
        streams = await asyncio.gather(*(collect(llm, p, f"r{i}") for i, p in enumerate(PROMPTS)))
        await wait_pool_full(llm)
        return streams

    streams = asyncio.run(main())
    for prompt, stream, expected in zip(PROMPTS, streams, reference):
        assert [o.finished for o in stream] == [False] * (len(stream) - 1) + [True]
        final = stream[-1]
        assert final.prompt_token_ids == prompt
        assert final.outputs[0].token_ids == expected
        assert final.outputs[0].finish_reason == "length"
        lengths = [len(o.outputs[0].token_ids) for o in stream]
        assert lengths == sorted(lengths) and lengths[0] >= 1  # cumulative
    assert not llm.output_processor.has_unfinished_requests()


def test_delta_and_final_only_agree_with_cumulative(llm):
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    prompt = [40, 41, 42, 43]

    async def main():
        return await asyncio.gather(
            collect(llm, prompt, "cumulative", params),
            collect(llm, prompt, "delta", params, output_kind=RequestOutputKind.DELTA),
            collect(llm, prompt, "final", params, output_kind=RequestOutputKind.FINAL_ONLY),
        )

    cumulative, delta, final = asyncio.run(main())
    whole = cumulative[-1].outputs[0]
    assert len(whole.token_ids) == 20 and whole.text
    assert "".join(o.outputs[0].text for o in delta) == whole.text
    assert sum((o.outputs[0].token_ids for o in delta), []) == whole.token_ids
    assert all(o.outputs[0].token_ids for o in delta)  # each delta carries its new token(s)
    assert delta[-1].finished and delta[-1].outputs[0].finish_reason == "length"
    assert len(final) == 1 and final[0].finished
    assert final[0].outputs[0].token_ids == whole.token_ids and final[0].outputs[0].text == whole.text


def test_bad_requests_raise_value_error_and_the_engine_goes_on(llm, reference):
    async def main():
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await collect(llm, [5, 100000], "bad-ids")
        with pytest.raises(ValueError, match="max_model_len"):
            await collect(llm, [5] * 200, "too-long")
        # Long enough to be still running when its id comes again, however
        # slowly this loop gets its turn beside the engine's process.
        agen = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True), "same")
        outputs = [await agen.__anext__()]
        with pytest.raises(ValueError, match="already in use"):
            await collect(llm, PROMPTS[0], "same")
        outputs += [o async for o in agen]
        return outputs[-1]

    final = asyncio.run(main())
    assert final.outputs[0].token_ids[: len(reference[0])] == reference[0]  # greedy: the same first tokens
    assert llm.is_running
    final = asyncio.run(collect(llm, PROMPTS[0], "after"))[-1]
    assert final.outputs[0].token_ids == reference[0]


def test_cancelling_a_stream_aborts_the_request_and_frees_its_blocks(inproc_llm, monkeypatch):
    llm = inproc_llm
    slow_down(llm, monkeypatch, 0.01)
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)

    async def main():
        # 1. Leaving the loop early.
        seen = 0
        async for output in llm.generate([1, 2, 3], params, "broken-off"):
            seen += 1
            if seen == 3:
                break
        # 2. Cancelling the consuming task.
        started = asyncio.Event()

        async def consume():
            async for _ in llm.generate([4, 5, 6] * 10, params, "cancelled"):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # 3. abort() from outside: the stream ends with finish_reason "abort".
        abort_me = asyncio.create_task(collect(llm, [9, 9], "aborted", params))
        await asyncio.sleep(0.05)
        llm.abort("aborted")
        aborted = (await asyncio.wait_for(abort_me, 10))[-1]
        await wait_pool_full(llm)
        # The engine still serves, also under a reused id.
        next_params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        return aborted, await collect(llm, [1, 2, 3], "cancelled", next_params)

    aborted, stream = asyncio.run(main())
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    assert 0 < len(aborted.outputs[0].token_ids) < 100
    final = stream[-1]
    assert final.finished and len(final.outputs[0].token_ids) == 3
    assert not llm.output_processor.has_unfinished_requests()


def test_submit_sends_at_once_and_a_dropped_stream_frees_its_blocks(inproc_llm, monkeypatch, reference):
    """submit() puts the request in the engine before anyone iterates (a
    server submits while its response is still being set up); a stream
    dropped unread, or closed midway, aborts its request."""
    llm = inproc_llm
    slow_down(llm, monkeypatch, 0.02)  # 100 tokens take 2 s: only an abort frees the blocks within 1 s
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)

    async def main():
        stream = llm.submit([1, 2, 3], params, "dropped")
        assert llm.output_processor.has_unfinished_requests()  # in the engine, nothing iterated
        await asyncio.sleep(0.05)
        del stream  # never read: abandoned
        await wait_pool_full(llm, timeout=1.0)
        closed = llm.submit([4, 5, 6], params, "closed")
        assert not (await closed.__anext__()).finished
        closed.close()
        await wait_pool_full(llm, timeout=1.0)
        with pytest.raises(ValueError):
            llm.submit([], params, "empty")  # a bad request fails at once, not at the first read
        read = [out async for out in llm.submit(PROMPTS[0], GREEDY, "read")]
        return read

    read = asyncio.run(main())
    assert read[-1].finished and read[-1].outputs[0].token_ids == reference[0]
    assert not llm.output_processor.has_unfinished_requests()


def test_engine_failure_reaches_every_waiter_and_later_calls_fail_fast(inproc_llm, monkeypatch):
    llm = inproc_llm
    execute = llm.engine.runner.execute
    calls = 0

    def failing(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("model exploded")
        return execute(*args, **kwargs)

    monkeypatch.setattr(llm.engine.runner, "execute", failing)
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)

    async def main():
        results = await asyncio.wait_for(
            asyncio.gather(*(collect(llm, p, f"r{i}", params) for i, p in enumerate(PROMPTS[:4])), return_exceptions=True),
            timeout=30,
        )
        started = time.monotonic()
        with pytest.raises(EngineDeadError):
            await collect(llm, [1, 2], "later")
        return results, time.monotonic() - started

    results, later = asyncio.run(main())
    assert all(isinstance(r, EngineDeadError) for r in results), results
    assert all("model exploded" in str(r) and isinstance(r.__cause__, RuntimeError) for r in results)
    assert later < 1.0
    assert llm.errored and not llm.is_running
    with pytest.raises(EngineDeadError):
        llm.check_health()


def test_the_event_loop_keeps_running_while_the_engine_steps(inproc_llm, monkeypatch):
    llm = inproc_llm
    step_seconds = 0.05
    slow_down(llm, monkeypatch, step_seconds)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)

    async def main():
        ticks = []
        done = asyncio.Event()

        async def ticker():
            while not done.is_set():
                ticks.append(time.monotonic())
                await asyncio.sleep(0.005)

        tick_task = asyncio.create_task(ticker())
        started = time.monotonic()
        await asyncio.gather(*(collect(llm, p, f"r{i}", params) for i, p in enumerate(PROMPTS[:3])))
        elapsed = time.monotonic() - started
        done.set()
        await tick_task
        return ticks, elapsed

    ticks, elapsed = asyncio.run(main())
    assert elapsed >= 20 * step_seconds
    # Blocked by the steps, the ticker would get about one tick per step at
    # best; free, it ticks many times per step and never waits a whole run.
    assert len(ticks) > 2 * 20
    gaps = [b - a for a, b in zip(ticks, ticks[1:])]
    assert max(gaps) < elapsed / 4


def test_reset_prefix_cache_between_streams_and_refused_during_one(llm):
    prompt = list(range(30, 70))
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)

    async def main():
        first = (await collect(llm, prompt, "a"))[-1]
        cached = (await collect(llm, prompt, "b"))[-1].num_cached_tokens
        reset = await llm.reset_prefix_cache()
        again = (await collect(llm, prompt, "c"))[-1]
        stream = llm.generate([1, 2, 3], long, "held")
        await stream.__anext__()  # running: its blocks are held
        refused = await llm.reset_prefix_cache()
        await stream.aclose()  # aborted: its blocks come back
        await wait_pool_full(llm)
        return first, cached, reset, again, refused, await llm.reset_prefix_cache()

    first, cached, reset, again, refused, after = asyncio.run(main())
    assert cached > 0 and reset is True and again.num_cached_tokens == 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert refused is False and after is True


def test_utility_calls_of_two_front_ends_of_one_core_each_get_their_answer(folder):
    """Two API server processes' clients on one engine-core process: calls
    from both, many at once, each answered on its caller's socket."""
    from pagoda.engine.arg_utils import EngineArgs

    first = make(folder, "process")
    second = AsyncLLM.from_engine_args(EngineArgs(model=folder, disable_log_stats=True, **ENGINE_ARGS),
                                       core_address=first.client.address, core_pid=first.core_pid, client_index=1)

    async def main():
        calls = [llm.reset_prefix_cache() for _ in range(10) for llm in (first, second)]
        return await asyncio.wait_for(asyncio.gather(*calls), 30)

    try:
        assert asyncio.run(main()) == [True] * 20
        assert asyncio.run(collect(second, PROMPTS[2], "after"))[-1].finished
    finally:
        second.shutdown()
        first.shutdown()


@pytest.mark.parametrize("mode", ["sync", "process"])
def test_shutdown_stops_the_core_and_fails_later_calls(folder, mode):
    llm = make(folder, mode)
    assert llm.is_running and not llm.errored
    llm.check_health()
    pid = llm.core_pid
    assert (pid is None) == (mode != "process") and pid != os.getpid()
    llm.shutdown()
    assert not llm.client.is_alive() and not llm.is_running
    if pid is not None:
        with pytest.raises(ProcessLookupError):  # stopped and reaped: no orphan left
            os.kill(pid, 0)
    with pytest.raises(EngineDeadError):
        asyncio.run(collect(llm, [1, 2], "after-shutdown"))
    with pytest.raises(EngineDeadError):
        asyncio.run(llm.reset_prefix_cache())
    llm.shutdown()  # idempotent


def test_a_killed_engine_core_process_fails_every_waiter(folder):
    """A core that dies without a word (SIGKILL, a crash) is noticed: every
    stream ends with EngineDeadError, health fails, later calls fail fast."""
    llm = make(folder, "process")
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)

    async def main():
        streams = [llm.generate(p, params, f"r{i}") for i, p in enumerate(PROMPTS[:3])]
        firsts = [await s.__anext__() for s in streams]
        os.kill(llm.core_pid, signal.SIGKILL)

        async def rest(stream):
            return [o async for o in stream]

        return firsts, await asyncio.wait_for(asyncio.gather(*(rest(s) for s in streams), return_exceptions=True), 30)

    try:
        firsts, results = asyncio.run(main())
        assert all(not f.finished for f in firsts)
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert llm.errored and "exited" in str(llm.dead_error)
        with pytest.raises(EngineDeadError):
            llm.check_health()
        with pytest.raises(EngineDeadError):
            asyncio.run(collect(llm, [1, 2], "later"))
    finally:
        llm.shutdown()


def test_from_engine_wraps_an_existing_engine(folder, reference):
    offline = LLM(folder, **ENGINE_ARGS)
    llm = AsyncLLM.from_engine(offline.llm_engine, disable_log_stats=True)
    try:
        final = asyncio.run(collect(llm, PROMPTS[2], "x"))[-1]
        assert final.outputs[0].token_ids == reference[2]
    finally:
        llm.shutdown()


def test_a_caller_leaving_as_its_request_finishes_does_not_kill_the_engine(llm):
    """The race the load tool found: the caller's cleanup removes its stream
    while the engine delivers that request's final output."""
    deliver = llm.client.on_outputs

    def deliver_after_callers_left(outputs):
        for output in outputs.outputs:
            if output.finished:
                with llm._lock:
                    llm._collectors.pop(output.request_id, None)
        deliver(outputs)

    llm.client.on_outputs = deliver_after_callers_left

    async def left():
        stream = llm.generate([5, 6], SamplingParams(max_tokens=2), "leaves")
        task = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.5)
        task.cancel()
        await stream.aclose()

    asyncio.run(left())
    llm.client.on_outputs = deliver

    async def next_request():
        return [out async for out in llm.generate([5, 6], GREEDY, "next")][-1]

    assert len(asyncio.run(next_request()).outputs[0].token_ids) == 12
    llm.check_health()


def test_a_lagging_caller_gets_its_deltas_merged():
    """Outputs a caller has not taken yet are merged into one (deltas
    concatenated, the newest finish state), so a slow consumer costs one
    wake-up and one chunk, not one per token; an error replaces them."""
    from pagoda.engine.async_llm import _Collector
    from pagoda.outputs import CompletionOutput, RequestOutput

    def delta(text, ids, finish=None):
        return RequestOutput("r", None, [1], None, [CompletionOutput(0, text, ids, finish_reason=finish)],
                             finished=finish is not None)

    async def main():
        collector = _Collector(delta=True)
        for out in (delta("a", [5]), delta("b", [6]), delta("c", [7], "length")):
            collector.put(out)
        merged = await collector.get()
        collector.put(delta("d", [8]))
        collector.put(RuntimeError("engine gone"))
        collector.put(delta("e", [9]))  # after the error: ignored
        return merged, await collector.get()

    merged, error = asyncio.run(main())
    assert merged.outputs[0].text == "abc" and merged.outputs[0].token_ids == [5, 6, 7]
    assert merged.finished and merged.outputs[0].finish_reason == "length"
    assert isinstance(error, RuntimeError)
