"""Start-up on the CPU: the CPU runner is chosen, and each phase is logged with
its time, then the runner's and the engine's totals."""

import logging

from pagoda import LLM
from pagoda.worker.cpu_model_runner import CPUModelRunner


def test_cpu_runner_and_startup_log(make_checkpoint, caplog):
    _, folder = make_checkpoint("llama")
    logger = logging.getLogger("pagoda")  # it does not propagate to the root, where caplog listens
    logger.addHandler(caplog.handler)
    try:
        llm = LLM(folder, device="cpu", dtype="float32", kv_cache_space=0.01, enforce_eager=True)
    finally:
        logger.removeHandler(caplog.handler)
    lines = caplog.messages
    runner = llm.llm_engine.runner
    assert isinstance(runner, CPUModelRunner) and runner.device.type == "cpu" and runner.graph_runner is None
    assert list(runner.startup_times) == ["weights", "KV cache"]
    weights = next(line for line in lines if line.startswith("weights: "))
    assert "LlamaForCausalLM" in weights and "float32" in weights and "GiB" in weights
    kv = next(line for line in lines if line.startswith("KV cache: "))
    assert f"{runner.num_blocks} blocks of 16 tokens" in kv
    assert any(line.startswith("model runner ready on cpu in ") for line in lines)
    assert any(line.startswith("engine ready in ") for line in lines)
