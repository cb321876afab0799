"""Turns the scheduler's decision into model inputs, runs the model on the
paged KV cache and returns logits. It never decides policy: what to run comes
in a SchedulerOutput, and plain tensors of logits go back out.

This base class is what the CPU and GPU runners share: start-up (weights,
then the KV cache size, the cache itself, CUDA graphs -- each phase timed and
logged), input preparation into persistent buffers, the forward pass (a CUDA
graph replay for padded decode steps where one was captured), logits and
prompt logits. Subclasses decide how many KV blocks fit and what to capture.
"""

from __future__ import annotations

import abc
import bisect
import contextlib
import time
from typing import Iterator

import numpy as np
import torch

from pagoda.config import FP8_KV_HEAD_SIZES, CacheConfig, ModelConfig, SchedulerConfig
from pagoda.core.scheduler import SchedulerOutput
from pagoda.forward_context import set_forward_context
from pagoda.logger import init_logger
from pagoda.model_executor.layers.attention import attention_layers, bind_kv_caches
from pagoda.model_executor.model_loader import get_model
from pagoda.worker.input_buffers import InputBuffers, ModelInputs

logger = init_logger(__name__)


class ModelRunner(abc.ABC):
    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, scheduler_config: SchedulerConfig):
        self.model_config, self.cache_config, self.scheduler_config = model_config, cache_config, scheduler_config
        self.device = model_config.device
        self.dtype = model_config.torch_dtype
        self.kv_cache_dtype = cache_config.kv_cache_torch_dtype(model_config)
        self.block_size = cache_config.block_size
        self.max_num_reqs = scheduler_config.max_num_seqs
        self.max_num_tokens = scheduler_config.max_num_batched_tokens
        self.max_blocks_per_req = -(-model_config.max_model_len // self.block_size)
        self.startup_times: dict[str, float] = {}  # phase -> seconds, in order
        # Decode steps of up to max(cudagraph_batch_sizes) requests are padded
        # to the next size; a size in graph_runner replays its CUDA graph, any
        # other runs the padded inputs eagerly. Empty: no padding.
        self.cudagraph_batch_sizes: list[int] = []
        self.graph_runner = None  # a CUDAGraphRunner (GPU runner, unless enforce_eager)
        self._previous_step: SchedulerOutput | None = None  # the last step executed: its logits rows
        with self.startup_phase("weights") as details:
            self.model = self.load_model()
            weights_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
            details.append(
                f"{model_config.model} ({type(self.model).__name__}, {str(self.dtype).replace('torch.', '')}, "
                f"load_format={model_config.load_format}): {weights_bytes / 2**30:.2f} GiB"
            )
        self.attention_layers = attention_layers(self.model)
        head_sizes = {layer.head_size for layer in self.attention_layers}
        if self.kv_cache_dtype == torch.float8_e4m3fn and not head_sizes <= set(FP8_KV_HEAD_SIZES):
            raise ValueError(f"kv_cache_dtype={cache_config.kv_cache_dtype!r} needs head sizes in {FP8_KV_HEAD_SIZES}, "
                             f"this model's are {sorted(head_sizes)}: use kv_cache_dtype='auto'")
        self.input_buffers = InputBuffers(
            self.max_num_tokens, self.max_num_reqs, self.max_blocks_per_req, self.block_size, self.device
        )
        self.num_blocks = self.determine_num_blocks()
        model_config.fit_to_kv_cache(self.num_blocks * self.block_size, self.memory_flag())
        with self.startup_phase("KV cache") as details:
            self.initialize_kv_cache(self.num_blocks)
            details.append(
                f"{self.num_blocks} blocks of {self.block_size} tokens = {self.num_blocks * self.block_size} tokens "
                f"({self.num_blocks * self.block_bytes() / 2**30:.2f} GiB, {str(self.kv_cache_dtype).removeprefix('torch.')})"
            )
        self.capture_model()
        logger.info(
            "model runner ready on %s in %.1f s (%s)", self.device, sum(self.startup_times.values()),
            ", ".join(f"{phase} {seconds:.1f} s" for phase, seconds in self.startup_times.items()),
        )

    # --- start-up -------------------------------------------------------------

    @contextlib.contextmanager
    def startup_phase(self, name: str) -> Iterator[list[str]]:
        """Times a start-up phase and logs it with what the body appends."""
        started = time.perf_counter()
        details: list[str] = []
        yield details
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # GPU work of the phase counts to it
        self.startup_times[name] = time.perf_counter() - started
        logger.info("%s: %.2f s%s", name, self.startup_times[name], "".join(": " + d for d in details))

    def load_model(self) -> torch.nn.Module:
        config = self.model_config
        torch.manual_seed(config.seed)
        return get_model(
            config.folder if config.gguf_file is None else config.folder / config.gguf_file,
            config.hf_config,
            self.dtype,
            load_format=config.load_format,
            gguf_file=config.gguf_file,
            device=self.device,
            quantization=config.quantization,
        )

    @abc.abstractmethod
    def determine_num_blocks(self) -> int:
        """How many KV cache blocks to allocate (num_gpu_blocks_override wins)."""

    def memory_flag(self) -> str:
        """The flag that makes the KV cache larger here (for error messages)."""
        if self.cache_config.num_gpu_blocks_override is not None:
            return "num_gpu_blocks_override"
        return "--kv-cache-space" if self.device.type == "cpu" else "--gpu-memory-utilization"

    def block_bytes(self) -> int:
        """Bytes of one KV cache block over all layers (keys and values)."""
        element = self.kv_cache_dtype.itemsize
        return sum(2 * self.block_size * layer.num_kv_heads * layer.head_size * element for layer in self.attention_layers)

    def max_useful_blocks(self) -> int:
        """More than every running sequence at full length can ever use is waste."""
        return self.max_num_reqs * self.max_blocks_per_req

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocates one (key_cache, value_cache) pair per attention layer and binds them."""
        # CPU: uninitialized -- attention reads only slots written this or
        # earlier steps, and untouched pages of a large cache cost no memory.
        # GPU: zeroed (milliseconds at HBM speed), so the block-0 reads of
        # padded decode rows see finite values.
        alloc = torch.empty if self.device.type == "cpu" else torch.zeros
        caches = []
        for layer in self.attention_layers:
            shape = (num_blocks, self.block_size, layer.num_kv_heads, layer.head_size)
            caches.append(tuple(alloc(shape, dtype=self.kv_cache_dtype, device=self.device) for _ in range(2)))
        bind_kv_caches(self.model, caches)

    def capture_model(self) -> None:
        """GPU runners capture CUDA graphs here."""

    # --- steps ----------------------------------------------------------------

    def padded_batch_size(self, scheduled: SchedulerOutput) -> int | None:
        """The CUDA-graph batch size a decode-only step pads to, or None (run
        as is: prefill in the step, padding off, or more requests than the
        largest size)."""
        sizes = self.cudagraph_batch_sizes
        items = scheduled.scheduled
        if not sizes or len(items) > sizes[-1] or any(len(item.token_ids) != 1 for item in items):
            return None
        return sizes[bisect.bisect_left(sizes, len(items))]

    def forward(self, inputs: ModelInputs) -> torch.Tensor:
        """Hidden states of every input row (padding rows included): a full
        CUDA graph's replay for a padded decode step, piecewise graphs' for a
        step they fit, else the model run eagerly."""
        graphs = self.graph_runner
        if graphs is not None and graphs.has_graph(inputs.padded_batch_size):
            return graphs.replay(inputs.padded_batch_size)
        with set_forward_context(inputs.metadata):
            size = None if graphs is None else graphs.piecewise_size(inputs.num_tokens)
            if size is not None:
                return graphs.replay_pieces(inputs.num_tokens, size)
            return self.model(inputs.input_ids, inputs.positions)

    @torch.inference_mode()
    def execute(
        self,
        scheduled: SchedulerOutput,
        block_tables: np.ndarray,
        prompt_logprob_ids: frozenset[str] = frozenset(),
        previous_sampled: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, tuple[int, torch.Tensor]]]:
        """Runs one step (block_tables: each scheduled request's whole block
        table, a row each, zero-padded). Returns the logits (in the model's dtype) of the
        requests that sample this step (in the order they appear in `scheduled`), and for each
        request in `prompt_logprob_ids` that computed prompt tokens this step,
        (first position, logits at its prompt positions that predict a prompt token).
        Both stay on the runner's device; nothing here waits for the GPU.
        previous_sampled: the token ids sampled from the previous execute's
        logits (on the device), where a request's last token is pending."""
        previous = self._previous_step if previous_sampled is not None else None
        inputs = self.input_buffers.prepare(scheduled, block_tables, self.padded_batch_size(scheduled), previous)
        self._previous_step = scheduled
        if inputs.pending_src.numel():
            # Queued behind the previous step on the device: no wait here.
            inputs.input_ids.index_copy_(0, inputs.pending_dst, previous_sampled.index_select(0, inputs.pending_src))
        hidden = self.forward(inputs)
        prompt_logits = {}
        for i, item in enumerate(scheduled.scheduled):
            if item.request_id not in prompt_logprob_ids:
                continue
            # Position p predicts prompt token p + 1: positions up to P - 2.
            end = min(item.start_position + len(item.token_ids), item.num_prompt_tokens - 1)
            if end > item.start_position:
                first_row = int(inputs.query_start_loc[i])
                chunk = hidden[first_row : first_row + end - item.start_position]
                prompt_logits[item.request_id] = (item.start_position, self.model.compute_logits(chunk))
        return self.sampling_logits(hidden, inputs.logits_indices), prompt_logits

    def logits_rows(self, num_rows: int) -> int:
        """The rows the LM head's GEMM runs for num_rows sampling rows: the next
        CUDA-graph batch size where one is that large, else num_rows."""
        sizes = self.cudagraph_batch_sizes
        if not num_rows or not sizes or num_rows > sizes[-1]:
            return num_rows
        return sizes[bisect.bisect_left(sizes, num_rows)]

    def sampling_logits(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The logits of hidden[rows], the LM head run on logits_rows() rows
        (zeros below them). A step's sampling rows take any count up to
        max_num_seqs, and each new count made cuBLAS choose, and the GPU
        driver load, another kernel: the host blocked for milliseconds while
        the GPU ran dry (H100, Llama-3.1-8B FP8, 3-5 ms in most prefill
        steps). Padded, the LM head sees the few shapes that the GPU runner
        ran at start-up (capture_model); the extra rows cost little (its
        weight's read dominates)."""
        padded = self.logits_rows(len(rows))
        if padded == len(rows):
            return self.model.compute_logits(hidden[rows])
        gathered = hidden.new_zeros(padded, hidden.shape[-1])
        torch.index_select(hidden, 0, rows, out=gathered[: len(rows)])
        return self.model.compute_logits(gathered)[: len(rows)]
