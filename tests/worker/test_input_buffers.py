"""InputBuffers: the model inputs of a step, built into persistent buffers
(the CUDA graphs' inputs on a GPU), checked on the CPU against a plain
per-token construction, with and without padding to a graph batch size."""

import random

import numpy as np
import pytest
import torch

from pagoda.core.scheduler import ScheduledRequest, SchedulerOutput
from pagoda.worker.input_buffers import InputBuffers

BLOCK_SIZE = 4
MAX_BLOCKS = 8  # max_model_len 32


def make_buffers(max_num_tokens=64, max_num_reqs=8):
    return InputBuffers(max_num_tokens, max_num_reqs, MAX_BLOCKS, BLOCK_SIZE, torch.device("cpu"))


def request(i, start, num_new, num_blocks=None, sample=True, prompt=10):
    """Request i with num_new tokens from position start; its blocks are
    distinct shuffled ids (block tables are not ranges)."""
    num_blocks = num_blocks or -(-(start + num_new) // BLOCK_SIZE)
    blocks = random.Random(i).sample(range(1, 100), num_blocks)
    tokens = [1000 * i + start + j for j in range(num_new)]
    return ScheduledRequest(f"r{i}", tokens, start, blocks, sample, prompt, reset_blocks=True)


def one_step(items):
    """The step's scheduler output and the block tables the worker keeps
    (here: each request's first, so its whole table), zero-padded."""
    width = max((len(item.new_block_ids) for item in items), default=0)
    tables = np.zeros((len(items), width), dtype=np.int32)
    for row, item in zip(tables, items):
        row[: len(item.new_block_ids)] = item.new_block_ids
    return SchedulerOutput(items), tables


def expected(items):
    """Per token, the obvious way."""
    ids, positions, slots, qsl, sample_rows = [], [], [], [0], []
    for item in items:
        for j, token in enumerate(item.token_ids):
            pos = item.start_position + j
            ids.append(token)
            positions.append(pos)
            slots.append(item.new_block_ids[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
        qsl.append(qsl[-1] + len(item.token_ids))
        if item.sample:
            sample_rows.append(qsl[-1] - 1)
    width = max(len(item.new_block_ids) for item in items)
    tables = [item.new_block_ids + [0] * (width - len(item.new_block_ids)) for item in items]
    seq_lens = [item.start_position + len(item.token_ids) for item in items]
    return ids, positions, slots, qsl, sample_rows, tables, seq_lens


def check_prefill(metadata, items):
    """The prefill view of the metadata against the obvious construction:
    the sequences after the leading decodes, renumbered from 0, and (when
    any has a cached prefix) every context token's cache slot."""
    num_decodes = next((i for i, item in enumerate(items) if len(item.token_ids) != 1), len(items))
    assert metadata.num_decodes == num_decodes
    prefill = metadata.prefill
    if num_decodes == len(items):
        assert prefill is None
        return
    rest = items[num_decodes:]
    qsl, ssl, slots = [0], [0], []
    for item in rest:
        seq_len = item.start_position + len(item.token_ids)
        qsl.append(qsl[-1] + len(item.token_ids))
        ssl.append(ssl[-1] + seq_len)
        slots += [item.new_block_ids[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(seq_len)]
    assert prefill.query_start_loc.tolist() == qsl and prefill.query_start_loc.dtype == torch.int32
    assert prefill.max_query_len == max(len(item.token_ids) for item in rest)
    assert prefill.max_seq_len == max(item.start_position + len(item.token_ids) for item in rest)
    if any(item.start_position for item in rest):
        assert prefill.seq_start_loc.tolist() == ssl and prefill.seq_start_loc.dtype == torch.int32
        assert prefill.context_slots.tolist() == slots and prefill.context_slots.dtype == torch.int64
    else:
        assert prefill.seq_start_loc.tolist() == qsl and prefill.context_slots is None


def test_mixed_step_matches_per_token_construction():
    # A prefill, a chunk in the middle of a prompt (no sampling), a prefix hit
    # resuming after two full blocks, and two decodes.
    items = [request(0, 0, 7), request(1, 4, 5, sample=False), request(2, 8, 3), request(3, 12, 1), request(4, 2, 1)]
    inputs = make_buffers().prepare(*one_step(items))
    ids, positions, slots, qsl, sample_rows, tables, seq_lens = expected(items)
    md = inputs.metadata
    assert inputs.input_ids.tolist() == ids and inputs.input_ids.dtype == torch.int64
    assert inputs.positions.tolist() == positions and inputs.positions.dtype == torch.int64
    assert md.slot_mapping.tolist() == slots and md.slot_mapping.dtype == torch.int64
    assert md.query_start_loc.tolist() == qsl and md.query_start_loc.dtype == torch.int32
    assert md.block_tables.tolist() == tables and md.block_tables.dtype == torch.int32
    assert md.seq_lens.tolist() == seq_lens and md.seq_lens.dtype == torch.int32
    assert inputs.logits_indices.tolist() == sample_rows
    assert (md.max_query_len, md.max_seq_len) == (7, max(seq_lens)) == (7, 13)
    assert inputs.query_start_loc.tolist() == qsl
    assert (inputs.num_reqs, inputs.num_tokens, inputs.padded_batch_size) == (5, 17, None)
    check_prefill(md, items)


def test_decodes_first_then_prefills_with_and_without_prefixes():
    buffers = make_buffers()
    decodes = [request(0, 12, 1), request(1, 2, 1)]
    fresh = [request(2, 0, 7), request(3, 0, 3)]
    for items in (decodes + fresh, decodes + [request(4, 8, 3)] + fresh, fresh, decodes):
        check_prefill(buffers.prepare(*one_step(items)).metadata, items)


def test_random_steps_reuse_the_same_buffers():
    """Many random steps in a row: each equals the per-token construction
    (nothing stale from the step before leaks in), and every input lives at
    the same address each time (what a CUDA graph relies on)."""
    buffers = make_buffers()
    rng = random.Random(0)
    addresses = None
    for step in range(50):
        items, budget = [], 64
        for i in range(rng.randint(1, 8)):
            start = rng.randint(0, 20)
            num_new = min(rng.randint(1, 12), budget, 32 - start)
            if num_new < 1:
                break
            budget -= num_new
            items.append(request(step * 10 + i, start, num_new, sample=rng.random() < 0.7))
        inputs = buffers.prepare(*one_step(items))
        ids, positions, slots, qsl, sample_rows, tables, seq_lens = expected(items)
        md = inputs.metadata
        assert inputs.input_ids.tolist() == ids
        assert inputs.positions.tolist() == positions
        assert md.slot_mapping.tolist() == slots
        assert md.query_start_loc.tolist() == qsl
        assert md.block_tables.tolist() == tables
        assert md.seq_lens.tolist() == seq_lens
        assert inputs.logits_indices.tolist() == sample_rows
        check_prefill(md, items)
        now = [t.data_ptr() for t in (inputs.input_ids, inputs.positions, md.slot_mapping, md.seq_lens,
                                      md.query_start_loc)]
        assert addresses in (None, now)
        addresses = now


def test_decode_step_padded_to_a_graph_batch_size():
    buffers = make_buffers()
    items = [request(0, 9, 1), request(1, 30, 1), request(2, 0, 1)]
    inputs = buffers.prepare(*one_step(items), pad_to=6)
    ids, positions, slots, qsl, sample_rows, tables, seq_lens = expected(items)
    md = inputs.metadata
    assert inputs.padded_batch_size == 6 and inputs.num_reqs == 3 and inputs.num_tokens == 3
    # Real rows first, then padding: token 0 at position 0, slot -1 (not
    # written), one token of context, block table starting at block 0.
    assert inputs.input_ids.tolist() == ids + [0] * 3
    assert inputs.positions.tolist() == positions + [0] * 3
    assert md.slot_mapping.tolist() == slots + [-1] * 3
    assert md.seq_lens.tolist() == seq_lens + [1] * 3
    assert md.query_start_loc.tolist() == [0, 1, 2, 3, 4, 5, 6]
    # Full width (max_model_len worth of blocks): one graph for any context.
    assert md.block_tables.shape == (6, MAX_BLOCKS)
    for row, item in enumerate(items):
        assert md.block_tables[row, : len(item.new_block_ids)].tolist() == item.new_block_ids
    assert md.block_tables[3:, 0].tolist() == [0, 0, 0]
    assert md.max_query_len == 1 and md.max_seq_len == MAX_BLOCKS * BLOCK_SIZE
    assert md.num_decodes == 6 and md.prefill is None
    # Logits only for the real rows; the host copy of query_start_loc too.
    assert inputs.logits_indices.tolist() == sample_rows == [0, 1, 2]
    assert inputs.query_start_loc.tolist() == qsl


def test_padded_tables_keep_their_address_and_shape_per_batch_size():
    buffers = make_buffers()
    first = buffers.prepare(*one_step([request(0, 3, 1)]), pad_to=4)
    second = buffers.prepare(*one_step([request(1, 20, 1), request(2, 5, 1)]), pad_to=4)
    for a, b in [(first.metadata.block_tables, second.metadata.block_tables), (first.input_ids, second.input_ids),
                 (first.metadata.seq_lens, second.metadata.seq_lens)]:
        assert a.data_ptr() == b.data_ptr() and a.shape == b.shape
    # The second step's rows replaced the first's where they are read.
    assert second.metadata.block_tables[0, :6].tolist() == request(1, 20, 1).new_block_ids
    assert second.metadata.seq_lens.tolist() == [21, 6, 1, 1]


def test_a_batch_of_padding_only_is_what_graph_capture_uses():
    inputs = make_buffers().prepare(SchedulerOutput(), pad_to=4)
    assert inputs.num_reqs == 0 and inputs.logits_indices.numel() == 0
    assert inputs.metadata.slot_mapping.tolist() == [-1] * 4
    assert inputs.metadata.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert inputs.metadata.seq_lens.tolist() == [1] * 4


def test_only_decode_steps_pad_and_limits_hold():
    buffers = make_buffers(max_num_tokens=16, max_num_reqs=4)
    with pytest.raises(ValueError, match="only decode steps"):
        buffers.prepare(*one_step([request(0, 0, 3)]), pad_to=4)
    with pytest.raises(RuntimeError, match="exceeds the input buffers"):
        buffers.prepare(*one_step([request(0, 0, 17)]))
    with pytest.raises(RuntimeError, match="exceeds the input buffers"):
        buffers.prepare(*one_step([request(i, 0, 1) for i in range(3)]), pad_to=8)
    with pytest.raises(RuntimeError, match="max_blocks_per_req"):
        buffers.prepare(*one_step([request(0, 0, 1, num_blocks=MAX_BLOCKS + 1)]))


def test_cpu_inputs_are_the_host_buffer_itself():
    """On the CPU nothing is copied: the model reads the numpy-filled memory."""
    buffers = make_buffers()
    inputs = buffers.prepare(*one_step([request(0, 0, 5)]))
    assert inputs.input_ids.data_ptr() == buffers.input_ids.cpu.data_ptr()
    assert np.shares_memory(buffers.input_ids.np, buffers.input_ids.cpu.numpy())
