"""CUDA graphs of the model's forward pass, captured once at start-up:

- full graphs of decode steps, one per batch size of a compact ladder: the
  whole forward pass, attention included, in one replay;
- piecewise graphs of the other steps (prefill or chunked prefill in the step,
  alone or beside decodes), one per token count of a coarser ladder: the model
  between attention calls is captured in pieces, and each layer's attention
  runs eagerly between them with the step's own metadata, whose shapes (the
  prompts' lengths) a graph could not fix. A step of T tokens replays the
  pieces of the next size up: pieces compute the padding rows too (stale
  inputs of earlier steps, never read back), attention only the step's rows.
  Per layer, the eager part is the rotary/cache-write kernel and the
  attention kernels; the rest (norms, GEMMs, activation, all-reduces) replays.

A graph reads its inputs from the runner's persistent InputBuffers and writes
the hidden states into one persistent buffer. A piece hands attention its q,
k and v through persistent per-shape buffers (copied inside the piece) and
reads attention's output from another, so the eager part finds its inputs at
the same addresses every replay. Capture goes largest size first into one
shared memory pool, so smaller graphs reuse the largest one's activation
memory; a size's pieces replay in the order they were captured, which is what
makes a pool shared between them safe.
"""

from __future__ import annotations

import bisect
import gc
from dataclasses import dataclass

import torch
from torch import nn

from pagoda.core.scheduler import SchedulerOutput
from pagoda.forward_context import set_forward_context, split_attention
from pagoda.model_executor.layers.attention import Attention
from pagoda.worker.input_buffers import InputBuffers


def cudagraph_batch_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16, up to and including
    max_batch_size: 20 graphs for 256 sequences, and padding wastes at most 15
    rows of a decode batch (whose cost is the weights' read, not the rows)."""
    sizes = {s for s in (1, 2, 4, 8) if s < max_batch_size} | set(range(16, max_batch_size, 16))
    return sorted(sizes | {max_batch_size})


def piecewise_token_sizes(max_tokens: int) -> list[int]:
    """Token counts of the piecewise graphs: multiples of 16 up to 128, of 32
    up to 256, of 64 beyond, and max_tokens itself: 16 sizes up to 512, and
    padding adds at most a quarter of a step's rows (beyond 16), whose GEMMs
    grow with them once a step is compute-bound."""
    sizes = set(range(16, min(max_tokens, 128) + 1, 16)) | set(range(160, min(max_tokens, 256) + 1, 32))
    sizes |= set(range(320, max_tokens + 1, 64))
    return sorted({s for s in sizes if s < max_tokens} | {max_tokens})


@dataclass
class _AttentionIO:
    """Where a piece leaves an attention layer's inputs and finds its output
    ([max tokens, width] each), shared by the layers of one shape."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor


@dataclass
class _EagerAttention:
    """One layer's attention between two pieces, as the capture saw it."""

    layer: Attention
    io: _AttentionIO
    positions: torch.Tensor | None  # the persistent positions buffer's view
    rotary_emb: nn.Module | None
    qk_norms: tuple | None

    def run(self, num_tokens: int) -> None:
        io, n = self.io, num_tokens
        self.layer.attend(io.q[:n], io.k[:n], io.v[:n], None if self.positions is None else self.positions[:n],
                          self.rotary_emb, self.qk_norms, out=io.out[:n])


class CUDAGraphRunner:
    def __init__(self, model: nn.Module, input_buffers: InputBuffers):
        self.model, self.input_buffers = model, input_buffers
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # decode batch size -> full graph
        # token count -> (pieces, the attention between piece i and i + 1)
        self.piecewise: dict[int, tuple[list[torch.cuda.CUDAGraph], list[_EagerAttention]]] = {}
        self._token_sizes: list[int] = []  # piecewise's keys, ascending (a step looks its size up)
        self.hidden_states: torch.Tensor | None = None  # [largest size, hidden], every graph's output
        self._io: dict[tuple, _AttentionIO] = {}
        self.pool = None

    @torch.inference_mode()
    def capture(self, batch_sizes: list[int], token_sizes: list[int]) -> None:
        """Full graphs for decode steps of batch_sizes requests, piecewise
        graphs for other steps of up to token_sizes tokens."""
        self.pool = torch.cuda.graph_pool_handle()
        rows = max([*batch_sizes, *token_sizes])
        # torch.cuda.graph() runs gc.collect() before each capture: with the
        # objects alive now frozen, those collections scan almost nothing.
        gc.collect()
        gc.freeze()
        try:
            for num_tokens in sorted(token_sizes, reverse=True):
                self._capture_pieces(num_tokens, rows)
            for batch_size in sorted(batch_sizes, reverse=True):
                self._capture(batch_size, rows)
        finally:
            gc.unfreeze()
        self._token_sizes = sorted(self.piecewise)
        torch.cuda.synchronize()

    def _output(self, hidden: torch.Tensor, rows: int) -> torch.Tensor:
        if self.hidden_states is None:
            self.hidden_states = hidden.new_empty((rows, hidden.shape[-1]))
        return self.hidden_states

    def _capture(self, batch_size: int, rows: int) -> None:
        # A batch of padding rows only: what the graph computes is fixed by
        # the buffers' addresses and shapes, not by these values.
        inputs = self.input_buffers.prepare(SchedulerOutput(), pad_to=batch_size)
        with set_forward_context(inputs.metadata):
            # Eager warm-up: lazy initialisation (library handles,
            # workspaces) stays out of the graph.
            output = self._output(self.model(inputs.input_ids, inputs.positions), rows)
            graph = torch.cuda.CUDAGraph()
            # thread_local: the engine may capture from a background thread
            # (AsyncLLM) while others run Python (never CUDA) meanwhile.
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                output[:batch_size] = self.model(inputs.input_ids, inputs.positions)
        self.graphs[batch_size] = graph

    def _capture_pieces(self, num_tokens: int, rows: int) -> None:
        input_ids = self.input_buffers.input_ids.gpu[:num_tokens]
        positions = self.input_buffers.positions.gpu[:num_tokens]
        pieces: list[torch.cuda.CUDAGraph] = []
        between: list[_EagerAttention] = []

        def split(layer, q, k, v, layer_positions=None, rotary_emb=None, qk_norms=None):
            io = self._io_for(layer, q, k, rows)
            io.q[:num_tokens].copy_(q)
            io.k[:num_tokens].copy_(k)
            io.v[:num_tokens].copy_(v)
            if pieces:  # capturing: this piece ends here, the next begins after the eager attention
                pieces[-1].capture_end()
                between.append(_EagerAttention(layer, io, layer_positions, rotary_emb, qk_norms))
                pieces.append(self._begin_piece())
            return io.out[:num_tokens]

        with split_attention(split):
            # Eager warm-up (with the split: the same kernels the pieces hold).
            output = self._output(self.model(input_ids, positions), rows)
            torch.cuda.synchronize()
            # Captured on a side stream, as torch.cuda.graph does.
            with torch.cuda.stream(torch.cuda.Stream()):
                pieces.append(self._begin_piece())
                output[:num_tokens] = self.model(input_ids, positions)
                pieces[-1].capture_end()
        self.piecewise[num_tokens] = pieces, between

    def _begin_piece(self) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
        return graph

    def _io_for(self, layer: Attention, q: torch.Tensor, k: torch.Tensor, rows: int) -> _AttentionIO:
        key = (q.shape[-1], k.shape[-1], q.dtype)
        if key not in self._io:
            def new(width: int) -> torch.Tensor:
                return torch.zeros((rows, width), dtype=q.dtype, device=q.device)

            q_width, kv_width = key[:2]
            self._io[key] = _AttentionIO(new(q_width), new(kv_width), new(kv_width),
                                         new(layer.num_heads * layer.head_size))
        return self._io[key]

    def has_graph(self, batch_size: int | None) -> bool:
        return batch_size in self.graphs

    def replay(self, batch_size: int) -> torch.Tensor:
        """Runs the graph of batch_size on the current buffers' contents;
        returns its hidden states (a view valid until the next replay)."""
        self.graphs[batch_size].replay()
        return self.hidden_states[:batch_size]

    def piecewise_size(self, num_tokens: int) -> int | None:
        """The token count whose pieces a step of num_tokens replays, or None
        (larger than every captured size)."""
        i = bisect.bisect_left(self._token_sizes, num_tokens)
        return self._token_sizes[i] if i < len(self._token_sizes) else None

    def replay_pieces(self, num_tokens: int, size: int) -> torch.Tensor:
        """Runs a step of num_tokens (its inputs in the buffers, its metadata
        set by set_forward_context) through the pieces of `size` (its
        piecewise_size); returns the hidden states of its rows (a view valid
        until the next replay)."""
        pieces, between = self.piecewise[size]
        for piece, attention in zip(pieces, between):
            piece.replay()
            attention.run(num_tokens)
        pieces[-1].replay()
        return self.hidden_states[:num_tokens]
