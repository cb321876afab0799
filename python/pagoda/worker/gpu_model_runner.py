"""The CUDA runner: weights made on the GPU, the KV cache sized from a
profiling forward pass and gpu_memory_utilization, and CUDA graphs (unless
enforce_eager): full graphs for decode steps, piecewise graphs for steps with
prefill of up to max_cudagraph_capture_size tokens.

KV cache size: one step of the largest shape the scheduler can send
(max_num_batched_tokens dummy tokens over min(max_num_seqs, tokens) prompts,
all sampling) runs through the model, the logits and the sampler; its peak
allocation (weights included) plus the memory outside torch's allocator (CUDA
context, other processes) is subtracted from gpu_memory_utilization x the
device's memory, and the rest becomes KV blocks. CUDA graphs are captured
after that, from memory the utilization leaves out (logged).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import numpy as np
import torch

from pagoda.core.scheduler import ScheduledRequest, SchedulerOutput
from pagoda.logger import init_logger
from pagoda.model_executor.layers import flash_prefill
from pagoda.model_executor.layers.sampler import Sampler, SamplingMetadata
from pagoda.model_executor.layers.triton_attention import variant_query_lens
from pagoda.sampling_params import SamplingParams
from pagoda.worker.cuda_graph_runner import CUDAGraphRunner, cudagraph_batch_sizes, piecewise_token_sizes
from pagoda.worker.model_runner import ModelRunner

logger = init_logger(__name__)

GiB = 1 << 30


class GPUModelRunner(ModelRunner):
    def determine_num_blocks(self) -> int:
        utilization = self.cache_config.gpu_memory_utilization
        with self.startup_phase("profiling") as details:
            peak = self.profile_run()
            free, total = torch.cuda.mem_get_info()
            outside_torch = total - free - torch.cuda.memory_reserved()
            available = int(total * utilization) - peak - outside_torch
            details.append(
                f"peak {peak / GiB:.2f} GiB in torch (weights and one step of {self.max_num_tokens} tokens), "
                f"{outside_torch / GiB:.2f} GiB outside it; gpu_memory_utilization={utilization} of "
                f"{total / GiB:.1f} GiB leaves {available / GiB:.2f} GiB for the KV cache"
            )
        with self.startup_phase("prefill kernels") as details:
            details.append(self._compile_prefill_kernels())
        override = self.cache_config.num_gpu_blocks_override
        if override is not None:
            return override
        num_blocks = available // self.block_bytes()
        if num_blocks < 1:
            raise ValueError(
                f"no GPU memory left for the KV cache: the weights and a step of max_num_batched_tokens="
                f"{self.max_num_tokens} tokens peak at {peak / GiB:.2f} GiB (+{outside_torch / GiB:.2f} GiB outside "
                f"torch) of the {utilization * total / GiB:.2f} GiB that gpu_memory_utilization={utilization} allows: "
                "raise gpu_memory_utilization or lower max_num_batched_tokens"
            )
        useful = self.max_useful_blocks()
        if num_blocks > useful:
            logger.info(
                "KV cache capped at %d blocks: max_num_seqs=%d sequences of max_model_len=%d tokens use no more",
                useful, self.max_num_reqs, self.model_config.max_model_len,
            )
        return int(min(num_blocks, useful))

    @torch.inference_mode()
    def profile_run(self) -> int:
        """Peak bytes torch allocates (weights included) for the largest step
        the scheduler can send."""
        num_tokens = self.max_num_tokens
        num_reqs = min(self.max_num_reqs, num_tokens)
        per_req, extra = divmod(num_tokens, num_reqs)
        lengths = [min(per_req + (i < extra), self.model_config.max_model_len) for i in range(num_reqs)]
        with self._stand_in_kv_cache():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            logits, _ = self.execute(*self._dummy_step(lengths))
            # The sampler's worst path: fp32 copies, logprobs, a full sort for top-k/top-p.
            params = [SamplingParams(temperature=1.0, top_k=50, top_p=0.9, logprobs=5)] * num_reqs
            Sampler()(logits, SamplingMetadata.from_requests(params, [[] for _ in params], device=self.device))
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
        del logits
        torch.cuda.empty_cache()
        return peak

    @contextlib.contextmanager
    def _stand_in_kv_cache(self) -> Iterator[None]:
        """A one-block KV cache for the start-up passes, dropped afterwards:
        every dummy token writes into block 0 (see _dummy_step)."""
        self.initialize_kv_cache(1)
        try:
            yield
        finally:
            for layer in self.attention_layers:
                layer.kv_cache = None

    def _dummy_step(self, lengths: list[int]) -> tuple[SchedulerOutput, np.ndarray]:
        """A step of prompts of these lengths, all sampling, every block id 0
        (with its block tables)."""
        blocks = [-(-n // self.block_size) for n in lengths]
        step = SchedulerOutput([ScheduledRequest(f"dummy-{i}", [0] * n, 0, [0] * b, True, n)
                                for i, (n, b) in enumerate(zip(lengths, blocks))])
        return step, np.zeros((len(lengths), max(blocks)), dtype=np.int32)

    def _compile_prefill_kernels(self) -> str:
        """Layers whose prefill torch's flash kernel serves need nothing. The
        Triton prefill kernel (the others') compiles one variant per query-tile
        height (from the step's longest new-token run) on first use: compiled
        here, at start-up, rather than inside the first requests, where a
        compile holds the engine for up to a second (Triton caches them in
        ~/.triton: later starts only load them)."""
        triton_layers = [layer for layer in self.attention_layers
                         if not flash_prefill.supported(self.dtype, self.device, layer.head_size)]
        if not triton_layers:
            return "torch's flash kernel (nothing to compile)"
        longest = min(self.max_num_tokens, self.model_config.max_model_len)
        lengths = sorted({n for layer in triton_layers
                          for n in variant_query_lens(layer.head_size, self.dtype, longest)})
        with self._stand_in_kv_cache():
            for num_tokens in lengths:
                self.execute(*self._dummy_step([num_tokens]))
        return f"Triton: query tiles for runs of up to {', '.join(map(str, lengths))} new tokens"

    def capture_model(self) -> None:
        if self.model_config.enforce_eager:
            logger.info("CUDA graphs: off (enforce_eager=True): every step runs eagerly")
            return
        max_tokens = min(self.model_config.max_cudagraph_capture_size, self.max_num_tokens)
        sizes = cudagraph_batch_sizes(min(self.max_num_reqs, max_tokens))
        token_sizes = piecewise_token_sizes(max_tokens)
        free_before, _ = torch.cuda.mem_get_info()
        with self.startup_phase("CUDA graphs") as details:
            graph_runner = CUDAGraphRunner(self.model, self.input_buffers)
            graph_runner.capture(sizes, token_sizes)
            # The LM head at each size sampling_logits pads to: every GEMM
            # kernel it will use chosen and loaded now, not inside a step.
            hidden = graph_runner.hidden_states
            for size in sizes:
                self.model.compute_logits(hidden.new_zeros(size, hidden.shape[-1]))
            details.append(
                f"{len(sizes)} decode batch sizes ({', '.join(map(str, sizes))}), piecewise for steps of up to "
                f"{max_tokens} tokens ({len(token_sizes)} sizes), "
                f"{(free_before - torch.cuda.mem_get_info()[0]) / 2**20:.0f} MiB"
            )
        self.graph_runner, self.cudagraph_batch_sizes = graph_runner, sizes
