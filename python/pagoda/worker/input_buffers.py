"""The model's per-step inputs in persistent buffers, shared by the CPU and GPU
runners.

Every field (token ids, positions, slot mapping, logits indices, sequence
lengths, query start locations, block tables) is a fixed slice of one flat
host buffer, filled with numpy, and of its device twin: a GPU step is one
non-blocking copy from pinned memory, and the device views keep their
addresses from step to step, so CUDA graphs captured on them read each step's
values. On the CPU the two are the same buffer.

Decode steps (one new token per sequence) can be padded to a CUDA-graph
batch size: a padded row has token 0 at position 0, slot -1 (reshape_and_cache
skips it), one token of context and block table row starting at block 0 (any
valid block: its output row is never read).

With async scheduling a request's newest token may still be on the device
(ScheduledRequest.last_token_pending): its input id is a placeholder here,
and pending_src/pending_dst say which of the previous step's sampled ids goes
into which input row -- the runner copies them on the device.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from pagoda.core.scheduler import SchedulerOutput
from pagoda.forward_context import AttentionMetadata, PrefillMetadata

_ALIGN = 64  # bytes; every field starts aligned for its dtype and for fast copies


@dataclass
class CpuGpuBuffer:
    """One field: its host tensor, a numpy view of it, and its device view."""

    cpu: torch.Tensor
    np: np.ndarray
    gpu: torch.Tensor


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # int64 [num_tokens] (padded steps: [padded_batch_size])
    positions: torch.Tensor  # int64, like input_ids
    metadata: AttentionMetadata
    logits_indices: torch.Tensor  # int64 [num_sampling_reqs]: rows of the hidden states that sample
    pending_src: torch.Tensor  # int64 [num_pending]: rows of the previous step's sampled ids ...
    pending_dst: torch.Tensor  # int64 [num_pending]: ... and the input rows they fill
    query_start_loc: np.ndarray  # host copy [num_reqs + 1], to slice rows without reading the device
    num_reqs: int
    num_tokens: int  # without padding
    padded_batch_size: int | None = None  # set on decode steps padded for a CUDA graph


class InputBuffers:
    def __init__(
        self, max_num_tokens: int, max_num_reqs: int, max_blocks_per_req: int, block_size: int, device: torch.device
    ):
        self.max_num_tokens, self.max_num_reqs = max_num_tokens, max_num_reqs
        self.max_blocks_per_req, self.block_size, self.device = max_blocks_per_req, block_size, device
        tokens, reqs = max_num_tokens, max_num_reqs
        fields = {
            "input_ids": (torch.int64, tokens),
            "positions": (torch.int64, tokens),
            "slot_mapping": (torch.int64, tokens),
            "logits_indices": (torch.int64, reqs),
            "pending_src": (torch.int64, reqs),
            "pending_dst": (torch.int64, reqs),
            "seq_lens": (torch.int32, reqs),
            "query_start_loc": (torch.int32, reqs + 1),
            "prefill_query_start_loc": (torch.int32, reqs + 1),
            "prefill_seq_start_loc": (torch.int32, reqs + 1),
            # Last, so a step copies only the rows it fills: [num_reqs, width] packed.
            "block_tables": (torch.int32, reqs * max_blocks_per_req),
        }
        offsets, total = {}, 0
        for name, (dtype, length) in fields.items():
            offsets[name] = total
            total += -(-length * dtype.itemsize // _ALIGN) * _ALIGN
        on_gpu = device.type != "cpu"
        self.host = torch.zeros(total, dtype=torch.uint8, pin_memory=on_gpu)
        self.device_buffer = torch.zeros(total, dtype=torch.uint8, device=device) if on_gpu else self.host
        for name, (dtype, length) in fields.items():
            start, end = offsets[name], offsets[name] + length * dtype.itemsize
            cpu = self.host[start:end].view(dtype)
            setattr(self, name, CpuGpuBuffer(cpu, cpu.numpy(), self.device_buffer[start:end].view(dtype)))
        self._block_tables_offset = offsets["block_tables"]
        # Padded steps read block tables of the full width (max_model_len worth
        # of blocks): the CUDA decode kernel sizes its grid from the shape, so
        # one captured graph serves every context length.
        self.padded_block_tables = torch.zeros((reqs, max_blocks_per_req), dtype=torch.int32, device=device)
        # Recorded after each host-to-device copy: the host buffer is not
        # refilled before the previous copy has read it.
        self._copied = torch.cuda.Event() if on_gpu else None

    def prepare(
        self, scheduled: SchedulerOutput, block_tables: np.ndarray | None = None, pad_to: int | None = None,
        previous: SchedulerOutput | None = None,
    ) -> ModelInputs:
        """Fills the buffers for one step: block_tables[i] is the whole block
        table of scheduled.scheduled[i], zero-padded to the widest ([num_reqs,
        width] int32; the worker keeps them, see BlockTable). With pad_to
        (a decode step only), appends padding rows up to that batch size.
        previous: the step whose
        sampled ids fill pending tokens (needed when a request's last token
        is pending); its sampling requests' order gives their rows."""
        items = scheduled.scheduled
        num_reqs = len(items)
        q_lens = np.fromiter((len(item.token_ids) for item in items), np.int64, num_reqs)
        num_tokens = int(q_lens.sum())
        width = block_tables.shape[1] if num_reqs else 0
        self._check_capacity(num_reqs, num_tokens, width, pad_to)
        if pad_to is not None and num_tokens != num_reqs:
            raise ValueError("only decode steps (one new token per request) can be padded to a CUDA-graph batch size")
        if self._copied is not None:
            self._copied.synchronize()

        query_start_loc = self.query_start_loc.np
        query_start_loc[0] = 0
        np.cumsum(q_lens, out=query_start_loc[1 : num_reqs + 1], dtype=np.int32)
        self.input_ids.np[:num_tokens] = np.fromiter(
            itertools.chain.from_iterable(item.token_ids for item in items), np.int64, num_tokens
        )
        req_index = np.repeat(np.arange(num_reqs), q_lens)
        starts = np.fromiter((item.start_position for item in items), np.int64, num_reqs)
        positions = self.positions.np[:num_tokens]
        np.add(starts[req_index], np.arange(num_tokens) - query_start_loc[req_index], out=positions)
        tables = self.block_tables.np[: num_reqs * width].reshape(num_reqs, width)
        if num_reqs:
            tables[:] = block_tables
        block_size = self.block_size
        np.add(
            tables[req_index, positions // block_size].astype(np.int64) * block_size,
            positions % block_size,
            out=self.slot_mapping.np[:num_tokens],
        )
        seq_lens = self.seq_lens.np
        seq_lens[:num_reqs] = starts + q_lens
        sampling = np.fromiter((item.sample for item in items), bool, num_reqs)
        num_sampling = int(sampling.sum())
        self.logits_indices.np[:num_sampling] = query_start_loc[1 : num_reqs + 1][sampling] - 1
        pending = [i for i, item in enumerate(items) if item.last_token_pending]
        if pending:
            sampling = (item.request_id for item in previous.scheduled if item.sample) if previous is not None else ()
            rows = {request_id: row for row, request_id in enumerate(sampling)}
            if any(items[i].request_id not in rows for i in pending):
                raise RuntimeError("a pending token that the previous step did not sample")
            self.pending_src.np[: len(pending)] = [rows[items[i].request_id] for i in pending]
            self.pending_dst.np[: len(pending)] = query_start_loc[1 : num_reqs + 1][pending] - 1
        max_seq_len = int(seq_lens[:num_reqs].max()) if num_reqs else 0
        max_query_len = int(q_lens.max()) if num_reqs else 0
        multi = np.flatnonzero(q_lens != 1)
        num_decodes = int(multi[0]) if len(multi) else num_reqs
        prefill = self._prefill_host(num_decodes, num_reqs, q_lens, starts) if num_decodes < num_reqs else None

        # Rows (requests) and tokens the model sees: equal when padded (decode).
        num_rows, num_input = (num_reqs, num_tokens) if pad_to is None else (pad_to, pad_to)
        if pad_to is not None:
            self.input_ids.np[num_reqs:pad_to] = 0
            self.positions.np[num_reqs:pad_to] = 0
            self.slot_mapping.np[num_reqs:pad_to] = -1
            seq_lens[num_reqs:pad_to] = 1
            query_start_loc[num_reqs + 1 : pad_to + 1] = np.arange(num_reqs + 1, pad_to + 1)
        num_bytes = self._block_tables_offset + num_reqs * width * 4
        if self.device_buffer is not self.host:
            self.device_buffer[:num_bytes].copy_(self.host[:num_bytes], non_blocking=True)
            self._copied.record()
        device_block_tables = self.block_tables.gpu[: num_reqs * width].view(num_reqs, width)
        if pad_to is not None:
            # Padding rows read column 0 only. Columns past a row's own blocks
            # keep earlier steps' (valid) ids: attention reads no block past
            # seq_len.
            self.padded_block_tables[:num_reqs, :width].copy_(device_block_tables)
            self.padded_block_tables[num_reqs:pad_to, 0] = 0
            device_block_tables = self.padded_block_tables[:pad_to]
            # The table's capacity, not this step's longest context: a graph
            # captured with these metadata serves any context length.
            max_seq_len, max_query_len = self.max_blocks_per_req * block_size, 1

        metadata = AttentionMetadata(
            slot_mapping=self.slot_mapping.gpu[:num_input],
            block_tables=device_block_tables,
            seq_lens=self.seq_lens.gpu[:num_rows],
            query_start_loc=self.query_start_loc.gpu[: num_rows + 1],
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            num_decodes=num_rows if prefill is None else num_decodes,
            prefill=self._prefill_device(prefill, device_block_tables[num_decodes:]) if prefill else None,
        )
        return ModelInputs(
            input_ids=self.input_ids.gpu[:num_input],
            positions=self.positions.gpu[:num_input],
            metadata=metadata,
            logits_indices=self.logits_indices.gpu[:num_sampling],
            pending_src=self.pending_src.gpu[: len(pending)],
            pending_dst=self.pending_dst.gpu[: len(pending)],
            query_start_loc=query_start_loc[: num_reqs + 1].copy(),
            num_reqs=num_reqs,
            num_tokens=num_tokens,
            padded_batch_size=pad_to,
        )

    def _prefill_host(self, num_decodes: int, num_reqs: int, q_lens: np.ndarray, starts: np.ndarray) -> tuple:
        """Fills the prefill fields (before the step's copy): the sequences
        after the leading decodes, renumbered from 0. Returns their host
        numbers for _prefill_device."""
        q_lens, starts = q_lens[num_decodes:], starts[num_decodes:]
        query_start_loc = self.prefill_query_start_loc.np
        query_start_loc[0] = 0
        np.cumsum(q_lens, out=query_start_loc[1 : len(q_lens) + 1], dtype=np.int32)
        seq_lens = starts + q_lens
        has_prefix = bool(starts.any())
        if has_prefix:
            seq_start_loc = self.prefill_seq_start_loc.np
            seq_start_loc[0] = 0
            np.cumsum(seq_lens, out=seq_start_loc[1 : len(q_lens) + 1], dtype=np.int32)
        return len(q_lens), int(q_lens.max()), int(seq_lens.max()), int(seq_lens.sum()), has_prefix

    def _prefill_device(self, prefill: tuple, block_tables: torch.Tensor) -> PrefillMetadata:
        num, max_query_len, max_seq_len, num_context, has_prefix = prefill
        query_start_loc = self.prefill_query_start_loc.gpu[: num + 1]
        if not has_prefix:
            return PrefillMetadata(query_start_loc, query_start_loc, max_query_len, max_seq_len, None)
        seq_start_loc = self.prefill_seq_start_loc.gpu[: num + 1]
        slots = context_slots(block_tables, seq_start_loc, num_context, self.block_size)
        return PrefillMetadata(query_start_loc, seq_start_loc, max_query_len, max_seq_len, slots)

    def _check_capacity(self, num_reqs: int, num_tokens: int, width: int, pad_to: int | None) -> None:
        # The scheduler's limits size these buffers; exceeding them is a bug upstream.
        rows = num_reqs if pad_to is None else pad_to
        if rows < num_reqs or rows > self.max_num_reqs or max(num_tokens, rows) > self.max_num_tokens:
            raise RuntimeError(
                f"a step of {num_reqs} requests / {num_tokens} tokens (padded to {pad_to}) exceeds the input "
                f"buffers ({self.max_num_reqs} requests, {self.max_num_tokens} tokens)"
            )
        if width > self.max_blocks_per_req:
            raise RuntimeError(f"a block table of {width} blocks exceeds max_blocks_per_req={self.max_blocks_per_req}")


def context_slots(block_tables: torch.Tensor, seq_start_loc: torch.Tensor, num_context: int,
                  block_size: int) -> torch.Tensor:
    """The cache slot of every context token of every sequence, in order
    (int64 [num_context]): sequence s owns entries seq_start_loc[s] ..
    seq_start_loc[s+1]-1, its positions 0, 1, ... On the tensors' device, so
    a GPU step builds it without reading the device."""
    token = torch.arange(num_context, device=block_tables.device)
    seq = torch.searchsorted(seq_start_loc[1:], token.to(seq_start_loc.dtype), right=True)
    position = token - seq_start_loc[seq]
    return block_tables[seq, position // block_size].long() * block_size + position % block_size
