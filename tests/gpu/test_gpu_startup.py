"""Start-up on a GPU: the device and dtype chosen, weights and caches made on
the GPU, the KV cache sized from the profiling pass (or the override), a
clear error when nothing is left for it, and one log line per phase."""

import logging

import pytest
import torch
from checkpoints import build_hf_model, save_checkpoint

from pagoda import LLM, SamplingParams
from pagoda.worker.gpu_model_runner import GPUModelRunner


def test_auto_picks_the_gpu_and_bf16(reference):
    llm = LLM(reference("llama").folder, skip_tokenizer_init=True, multiprocess=False)
    runner = llm.llm_engine.runner
    assert isinstance(runner, GPUModelRunner) and runner.device.type == "cuda"
    assert runner.dtype == torch.bfloat16  # an fp32 checkpoint runs in bf16 on a GPU
    assert all(p.device.type == "cuda" for p in runner.model.parameters())
    assert all(b.device.type == "cuda" for b in runner.model.buffers())
    key_cache, value_cache = runner.attention_layers[0].kv_cache
    assert key_cache.device.type == "cuda" and key_cache.dtype == torch.bfloat16
    assert key_cache.shape[0] == runner.num_blocks
    # Plenty of memory for a tiny model: every sequence can reach max_model_len.
    assert runner.num_blocks == runner.max_useful_blocks()


def test_fp16_checkpoint_stays_fp16(tmp_path):
    folder = save_checkpoint(build_hf_model("qwen2").half(), str(tmp_path))
    llm = LLM(folder, skip_tokenizer_init=True, multiprocess=False, enforce_eager=True)
    assert llm.llm_engine.runner.dtype == torch.float16
    assert len(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
               .outputs[0].token_ids) == 4


def test_cpu_still_selectable(reference):
    llm = LLM(reference("llama").folder, skip_tokenizer_init=True, multiprocess=False, device="cpu", dtype="float32",
              kv_cache_space=0.01)
    assert llm.llm_engine.runner.device.type == "cpu"


def test_override_and_too_little_memory(reference):
    folder = reference("llama").folder
    assert LLM(folder, skip_tokenizer_init=True, multiprocess=False, num_gpu_blocks_override=7).llm_engine.runner.num_blocks == 7
    used = torch.cuda.mem_get_info()[1] - torch.cuda.mem_get_info()[0]
    too_little = max(used / torch.cuda.mem_get_info()[1] / 2, 1e-4)
    with pytest.raises(ValueError, match="raise gpu_memory_utilization or lower max_num_batched_tokens"):
        LLM(folder, skip_tokenizer_init=True, multiprocess=False, gpu_memory_utilization=too_little)
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        LLM(folder, skip_tokenizer_init=True, multiprocess=False, gpu_memory_utilization=1.5)


def test_startup_phases_are_logged(reference, caplog):
    logger = logging.getLogger("pagoda")  # it does not propagate to the root, where caplog listens
    logger.addHandler(caplog.handler)
    try:
        LLM(reference("qwen3").folder, skip_tokenizer_init=True, multiprocess=False, load_format="dummy")
    finally:
        logger.removeHandler(caplog.handler)
    lines = caplog.messages
    for phase in ("weights", "profiling", "prefill kernels", "KV cache", "CUDA graphs"):
        assert any(line.startswith(f"{phase}: ") for line in lines), f"no {phase} line in {lines}"
    ready = [line for line in lines if line.startswith("model runner ready on cuda")]
    assert len(ready) == 1 and all(p in ready[0] for p in ("weights", "profiling", "KV cache", "CUDA graphs"))
    assert any(line.startswith("engine ready in ") for line in lines)


def _compiled_prefill_variants() -> int:
    """Variants of the Triton prefill kernel compiled in this process (Triton
    3.x keeps them per device, the compiled kernels first in each entry)."""
    from pagoda.model_executor.layers.triton_attention import _paged_prefill_kernel

    return sum(len(entry[0]) for entry in _paged_prefill_kernel.device_caches.values())


def test_no_prefill_kernel_compiles_while_serving(reference):
    """Start-up compiles every tile variant a step can need: runs of 2 to 16
    new tokens (a prefix hit leaving one block, a chunk's tail) included, so
    none is compiled at first use inside serving, where it holds the engine."""
    # 8 sequences: the profiling step's prompts are long (128 tokens), so it
    # compiles none of the short runs' variants itself. float32: torch's flash
    # kernel takes bf16/fp16 prefill, Triton the rest.
    llm = LLM(reference("qwen3").folder, skip_tokenizer_init=True, multiprocess=False, load_format="dummy", max_num_seqs=8,
              dtype="float32")
    compiled = _compiled_prefill_variants()
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    base = list(range(1, 33))
    # One prompt per step (each its own longest run): prompts of every tile
    # class up to max_model_len (128), and prefix hits (prefix caching is on
    # by default) that leave 1 to 16 new tokens.
    prompts = [list(range(40, 40 + n)) for n in (2, 5, 16, 17, 40, 64, 100, 120)]
    prompts += [base + list(range(200, 200 + n)) for n in (1, 3, 16)]
    for prompt in [base] + prompts:
        llm.generate([prompt], params, use_tqdm=False)
    assert compiled > 0 and _compiled_prefill_variants() == compiled
