"""CUDA graphs of the model's decode forward pass, one per batch size of a
compact ladder, captured once at start-up and replayed every decode step.

A graph reads its inputs from the runner's persistent InputBuffers (a padded
decode step fills them) and writes the hidden states into one persistent
buffer. Capture goes largest batch first into one shared memory pool, so the
smaller graphs reuse the largest one's activation memory.
"""

from __future__ import annotations

import gc

import torch
from torch import nn

from pagoda.core.scheduler import SchedulerOutput
from pagoda.forward_context import set_forward_context
from pagoda.worker.input_buffers import InputBuffers


def cudagraph_batch_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16, up to and including
    max_batch_size: 20 graphs for 256 sequences, and padding wastes at most 15
    rows of a decode batch (whose cost is the weights' read, not the rows)."""
    sizes = {s for s in (1, 2, 4, 8) if s < max_batch_size} | set(range(16, max_batch_size, 16))
    return sorted(sizes | {max_batch_size})


class CUDAGraphRunner:
    def __init__(self, model: nn.Module, input_buffers: InputBuffers):
        self.model, self.input_buffers = model, input_buffers
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.hidden_states: torch.Tensor | None = None  # [largest batch size, hidden], every graph's output
        self.pool = None

    @torch.inference_mode()
    def capture(self, batch_sizes: list[int]) -> None:
        self.pool = torch.cuda.graph_pool_handle()
        # torch.cuda.graph() runs gc.collect() before each capture: with the
        # objects alive now frozen, those collections scan almost nothing.
        gc.collect()
        gc.freeze()
        try:
            for batch_size in sorted(batch_sizes, reverse=True):
                self._capture(batch_size)
        finally:
            gc.unfreeze()
        torch.cuda.synchronize()

    def _capture(self, batch_size: int) -> None:
        # A batch of padding rows only: what the graph computes is fixed by
        # the buffers' addresses and shapes, not by these values.
        inputs = self.input_buffers.prepare(SchedulerOutput(), pad_to=batch_size)
        with set_forward_context(inputs.metadata):
            # Eager warm-up: lazy initialisation (library handles,
            # workspaces) stays out of the graph.
            hidden = self.model(inputs.input_ids, inputs.positions)
            if self.hidden_states is None:
                self.hidden_states = torch.empty_like(hidden)
            graph = torch.cuda.CUDAGraph()
            # thread_local: the engine may capture from a background thread
            # (AsyncLLM) while others run Python (never CUDA) meanwhile.
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                self.hidden_states[:batch_size] = self.model(inputs.input_ids, inputs.positions)
        self.graphs[batch_size] = graph

    def has_graph(self, batch_size: int | None) -> bool:
        return batch_size in self.graphs

    def replay(self, batch_size: int) -> torch.Tensor:
        """Runs the graph of batch_size on the current buffers' contents;
        returns its hidden states (a view valid until the next replay)."""
        self.graphs[batch_size].replay()
        return self.hidden_states[:batch_size]
