"""/health tells the truth: 200 while the engine idles or steps, 503 when
its loop died or has not finished a step for longer than the threshold while
requests are pending, and 200 again once it steps."""

import threading
import time

import httpx

from conftest import ENGINE_ARGS, MODEL, RunningServer, assert_error


def health(server):
    return httpx.get(server.url + "/health", timeout=10)


def test_stalled_engine_fails_health(model_folder, monkeypatch):
    from pagoda.engine.async_llm import AsyncLLM

    running = RunningServer(AsyncLLM(model_folder, disable_log_stats=True, **ENGINE_ARGS), MODEL,
                            engine_stall_timeout=0.5)
    try:
        time.sleep(0.8)
        assert health(running).status_code == 200  # idle that long is not a stall
        core = running.engine.engine.core
        release, step = threading.Event(), core.step

        def blocked_step():
            release.wait(30)  # a hung kernel, until released
            return step()

        monkeypatch.setattr(core, "step", blocked_step)
        result = {}
        body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3}
        request = threading.Thread(target=lambda: result.update(
            r=httpx.post(running.url + "/v1/completions", json=body, timeout=60)))
        request.start()
        assert health(running).status_code == 200  # within the threshold
        deadline = time.monotonic() + 10
        while (r := health(running)).status_code == 200:
            assert time.monotonic() < deadline, "/health never noticed the stalled engine"
            time.sleep(0.05)
        assert_error(r, 503, says="has not completed a step")
        monkeypatch.setattr(core, "step", step)
        release.set()
        request.join(30)
        assert result["r"].status_code == 200
        assert health(running).status_code == 200
    finally:
        release.set()
        running.stop()


def test_busy_engine_with_slow_steps_is_healthy(model_folder, monkeypatch):
    """Steps shorter than the threshold never fail it, however long the request."""
    from conftest import slow_steps

    from pagoda.engine.async_llm import AsyncLLM

    running = RunningServer(AsyncLLM(model_folder, disable_log_stats=True, **ENGINE_ARGS), MODEL,
                            engine_stall_timeout=0.5)
    try:
        slow_steps(monkeypatch, running.engine, 0.1)
        body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 15, "ignore_eos": True}
        request = threading.Thread(target=httpx.post, args=(running.url + "/v1/completions",),
                                   kwargs=dict(json=body, timeout=60))
        request.start()
        while request.is_alive():
            assert health(running).status_code == 200
            time.sleep(0.05)
    finally:
        running.stop()
