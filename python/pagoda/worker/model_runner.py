"""Turns the scheduler's decision into model inputs, runs the model on the
paged KV cache and samples. It never decides policy: what to run comes in a
SchedulerOutput, and plain token ids (and logprobs) go back out."""

from __future__ import annotations

import time

import torch

from pagoda.config import CacheConfig, ModelConfig, SchedulerConfig
from pagoda.core.scheduler import SchedulerOutput
from pagoda.forward_context import AttentionMetadata, set_forward_context
from pagoda.logger import init_logger
from pagoda.model_executor.layers.attention import Attention
from pagoda.model_executor.model_loader import get_model

logger = init_logger(__name__)


class ModelRunner:
    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, scheduler_config: SchedulerConfig):
        self.model_config = model_config
        self.block_size = cache_config.block_size
        self.device = torch.device("cpu")
        started = time.perf_counter()
        torch.manual_seed(model_config.seed)
        self.model = get_model(
            model_config.folder if model_config.gguf_file is None else model_config.folder / model_config.gguf_file,
            model_config.hf_config,
            model_config.torch_dtype,
            load_format=model_config.load_format,
            gguf_file=model_config.gguf_file,
        )
        weights_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        logger.info(
            "loaded %s (%s, %s) in %.1f s: %.2f GiB of weights",
            model_config.model, type(self.model).__name__, str(model_config.torch_dtype).replace("torch.", ""),
            time.perf_counter() - started, weights_bytes / 2**30,
        )
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.num_blocks = self._num_blocks(cache_config, scheduler_config)
        self._allocate_kv_cache()

    def _block_bytes(self) -> int:
        element = torch.empty((), dtype=self.model_config.torch_dtype).element_size()
        return sum(2 * self.block_size * layer.num_kv_heads * layer.head_size * element for layer in self.attention_layers)

    def _num_blocks(self, cache_config: CacheConfig, scheduler_config: SchedulerConfig) -> int:
        if cache_config.num_gpu_blocks_override is not None:
            return cache_config.num_gpu_blocks_override
        by_space = cache_config.kv_cache_bytes // self._block_bytes()
        # More than every running sequence at full length can ever use is waste.
        useful = scheduler_config.max_num_seqs * -(-self.model_config.max_model_len // self.block_size)
        num_blocks = min(by_space, useful)
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_space={cache_config.kv_cache_space} holds no KV cache block of "
                f"{self._block_bytes()} bytes: raise kv_cache_space"
            )
        return int(num_blocks)

    def _allocate_kv_cache(self) -> None:
        dtype = self.model_config.torch_dtype
        for layer in self.attention_layers:
            shape = (self.num_blocks, self.block_size, layer.num_kv_heads, layer.head_size)
            # Uninitialized: attention reads only slots written this or earlier
            # steps, and untouched pages of a large cache cost no memory.
            layer.kv_cache = (torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype))
        logger.info(
            "KV cache: %d blocks of %d tokens = %d tokens (%.2f GiB)",
            self.num_blocks, self.block_size, self.num_blocks * self.block_size,
            self.num_blocks * self._block_bytes() / 2**30,
        )

    def prepare_inputs(self, scheduled: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Flattened token ids and positions of all scheduled requests, and the
        attention metadata locating each request's KV in the paged cache."""
        items = scheduled.scheduled
        q_lens = torch.tensor([len(item.token_ids) for item in items], dtype=torch.int32)
        starts = torch.tensor([item.start_position for item in items], dtype=torch.int32)
        query_start_loc = torch.zeros(len(items) + 1, dtype=torch.int32)
        torch.cumsum(q_lens, 0, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        input_ids = torch.tensor([t for item in items for t in item.token_ids], dtype=torch.long)
        seq_index = torch.repeat_interleave(torch.arange(len(items)), q_lens)
        positions = (starts - query_start_loc[:-1])[seq_index].long() + torch.arange(num_tokens)
        max_blocks = max(len(item.block_ids) for item in items)
        block_tables = torch.tensor(
            [item.block_ids + [0] * (max_blocks - len(item.block_ids)) for item in items], dtype=torch.int32
        )
        slot_mapping = block_tables[seq_index, positions // self.block_size].long() * self.block_size
        slot_mapping += positions % self.block_size
        seq_lens = starts + q_lens
        metadata = AttentionMetadata(
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            seq_lens=seq_lens,
            query_start_loc=query_start_loc,
            max_query_len=int(q_lens.max()),
            max_seq_len=int(seq_lens.max()),
        )
        return input_ids, positions, metadata

    @torch.inference_mode()
    def execute(
        self, scheduled: SchedulerOutput, prompt_logprob_ids: frozenset[str] = frozenset()
    ) -> tuple[torch.Tensor, dict[str, tuple[int, torch.Tensor]]]:
        """Runs one step. Returns float32 logits of the requests that sample
        this step (in the order they appear in `scheduled`), and for each
        request in `prompt_logprob_ids` that computed prompt tokens this step,
        (first position, logits at its prompt positions that predict a prompt token)."""
        input_ids, positions, metadata = self.prepare_inputs(scheduled)
        with set_forward_context(metadata):
            hidden = self.model(input_ids, positions)
        rows = [i for i, item in enumerate(scheduled.scheduled) if item.sample]
        last_token = (metadata.query_start_loc[1:] - 1)[rows].long()
        prompt_logits = {}
        for i, item in enumerate(scheduled.scheduled):
            if item.request_id not in prompt_logprob_ids:
                continue
            # Position p predicts prompt token p + 1: positions up to P - 2.
            end = min(item.start_position + len(item.token_ids), item.num_prompt_tokens - 1)
            if end > item.start_position:
                first_row = int(metadata.query_start_loc[i])
                chunk = hidden[first_row : first_row + end - item.start_position]
                prompt_logits[item.request_id] = (item.start_position, self.model.compute_logits(chunk))
        return self.model.compute_logits(hidden[last_token]), prompt_logits
