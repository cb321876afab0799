"""The Hugging Face transformers baseline: `generate` on the very requests
Pagoda ran, on the same device, in the same dtype, with the same model
(the same checkpoint, or for dummy weights the same config with random
init: with EOS ignored the values do not matter).

Requests go in batches of `batch_size`, in request order (as vLLM's own HF
baseline): prompts left-padded with an attention mask; a batch generates its
longest output length, with EOS off so no row stops early, and each request
counts only its own expected_output_len tokens -- the rest is the padding
cost of static batching that the baseline really pays."""

from __future__ import annotations

import time

import torch
from tqdm import tqdm

from pagoda.benchmarks.datasets import SampleRequest
from pagoda.config import ModelConfig


def load_hf_model(model_config: ModelConfig, device: torch.device):
    from transformers import AutoModelForCausalLM

    dtype = model_config.torch_dtype
    if model_config.load_format == "dummy":
        config = model_config.hf_config
        if hasattr(config, "to_transformers"):  # Pagoda's own (HFConfig), not a transformers class
            config = config.to_transformers()
        with torch.device(device):  # random init right on the device
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    elif model_config.gguf_file:
        model = AutoModelForCausalLM.from_pretrained(model_config.folder, gguf_file=model_config.gguf_file, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_config.folder, dtype=dtype)
    return model.to(device).eval()


def left_pad(batch: list[SampleRequest], pad_token_id: int, device: torch.device):
    """(input_ids, attention_mask) of a batch, prompts right-aligned: new
    tokens then follow every prompt directly."""
    width = max(r.prompt_len for r in batch)
    input_ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, request in enumerate(batch):
        input_ids[row, width - request.prompt_len:] = torch.tensor(request.prompt_token_ids)
        attention_mask[row, width - request.prompt_len:] = 1
    return input_ids.to(device), attention_mask.to(device)


def run_hf(model, requests: list[SampleRequest], batch_size: int, temperature: float, seed: int = 0,
           use_tqdm: bool = True) -> tuple[float, int]:
    """(elapsed seconds, output tokens counted) for generating every request.
    Sampling matches the Pagoda run: temperature (0 = greedy), no top-k/top-p."""
    config = model.config
    pad_token_id = config.pad_token_id if isinstance(config.pad_token_id, int) else 0
    device = model.device
    sampling = dict(do_sample=False) if temperature == 0 else dict(do_sample=True, temperature=temperature,
                                                                   top_k=0, top_p=1.0)

    def generate(batch: list[SampleRequest]) -> None:
        input_ids, attention_mask = left_pad(batch, pad_token_id, device)
        new_tokens = max(r.expected_output_len for r in batch)
        with torch.no_grad():
            out = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, eos_token_id=None, pad_token_id=pad_token_id, **sampling)
        if out.shape[1] - input_ids.shape[1] != new_tokens:
            raise RuntimeError(f"transformers generated {out.shape[1] - input_ids.shape[1]} tokens, not {new_tokens}")

    torch.manual_seed(seed)
    generate([SampleRequest(requests[0].prompt_token_ids, 2)])  # warm-up: first-call setup is not throughput
    batches = [requests[i:i + batch_size] for i in range(0, len(requests), batch_size)]
    _synchronize(device)
    started = time.perf_counter()
    for batch in tqdm(batches, desc="transformers batches", dynamic_ncols=True, disable=not use_tqdm):
        generate(batch)
    _synchronize(device)
    return time.perf_counter() - started, sum(r.expected_output_len for r in requests)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
