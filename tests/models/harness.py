"""Drives a model the way the model runner will: paged KV caches bound to its
Attention layers, and per step an AttentionMetadata for a batch of sequences
each contributing some new tokens (prefill, chunked prefill, decode mixed).

Reference: Hugging Face's logits over each sequence's full token list (one
forward without cache). Whatever the schedule, our logits for the token at
position p must match that reference's row p.
"""

from __future__ import annotations

import random

import torch

from pagoda.forward_context import AttentionMetadata, set_forward_context
from pagoda.model_executor.layers.attention import attention_layers, bind_kv_caches


class PagedRunner:
    def __init__(self, model, dtype: torch.dtype, num_blocks: int = 64, block_size: int = 4, seed: int = 0):
        self.model, self.block_size, self.dtype = model, block_size, dtype
        caches = []
        for layer in attention_layers(model):
            shape = (num_blocks, block_size, layer.num_kv_heads, layer.head_size)
            # NaN-filled: a kernel reading a slot nobody wrote shows up at once.
            caches.append((torch.full(shape, float("nan"), dtype=dtype), torch.full(shape, float("nan"), dtype=dtype)))
        bind_kv_caches(model, caches)
        # Blocks in shuffled order: block tables are not contiguous ranges.
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.blocks: dict[int, list[int]] = {}
        self.num_cached: dict[int, int] = {}

    def share_prefix(self, seq: int, source: int, num_blocks: int) -> int:
        """Prefix caching: seq starts with source's first num_blocks full blocks
        (same tokens) and computes only what follows. Returns the number of
        tokens it skips."""
        self.blocks[seq] = list(self.blocks[source][:num_blocks])
        self.num_cached[seq] = num_blocks * self.block_size
        return self.num_cached[seq]

    def step(self, new_tokens: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """new_tokens: sequence id -> its next tokens. Returns sequence id ->
        fp32 logits [len(new tokens), vocab]."""
        seqs = list(new_tokens)
        input_ids, positions, slots, seq_lens, starts = [], [], [], [], [0]
        for seq in seqs:
            tokens, done = new_tokens[seq], self.num_cached.get(seq, 0)
            table = self.blocks.setdefault(seq, [])
            for pos in range(done, done + len(tokens)):
                if pos // self.block_size == len(table):
                    table.append(self.free_blocks.pop())
                slots.append(table[pos // self.block_size] * self.block_size + pos % self.block_size)
            input_ids += tokens
            positions += range(done, done + len(tokens))
            self.num_cached[seq] = done + len(tokens)
            seq_lens.append(done + len(tokens))
            starts.append(starts[-1] + len(tokens))
        width = max(len(self.blocks[s]) for s in seqs)
        tables = [self.blocks[s] + [0] * (width - len(self.blocks[s])) for s in seqs]
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_tables=torch.tensor(tables, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            max_query_len=max(len(t) for t in new_tokens.values()),
            max_seq_len=max(seq_lens),
        )
        with torch.inference_mode(), set_forward_context(metadata):
            hidden = self.model(torch.tensor(input_ids, dtype=torch.int64), torch.tensor(positions, dtype=torch.int64))
            logits = self.model.compute_logits(hidden)
        assert logits.dtype == self.dtype  # the model's: the sampler widens them
        logits = logits.float()
        return {seq: logits[starts[i] : starts[i + 1]] for i, seq in enumerate(seqs)}


def run_schedule(
    runner: PagedRunner, sequences: list[list[int]], first: list[int], then: list[int]
) -> list[torch.Tensor]:
    """Feeds sequence s first[s] tokens in the first step and then[s] tokens in
    each later one, all unfinished sequences batched together in every step;
    returns per sequence the logits of all its tokens."""
    out = [[] for _ in sequences]
    fed = [0] * len(sequences)
    while any(fed[s] < len(tokens) for s, tokens in enumerate(sequences)):
        batch = {}
        for s, tokens in enumerate(sequences):
            if fed[s] < len(tokens):
                batch[s] = tokens[fed[s] : fed[s] + (then[s] if fed[s] else first[s])]
                fed[s] += len(batch[s])
        for s, logits in runner.step(batch).items():
            out[s].append(logits)
    return [torch.cat(chunks) for chunks in out]


def hf_greedy(hf_model, prompt: list[int], num_new: int) -> tuple[list[int], torch.Tensor]:
    """Greedy continuation by repeated full forwards (no cache to trust), and
    the fp32 logits of every position of prompt + continuation[:-1]."""
    tokens = list(prompt)
    with torch.inference_mode():
        for _ in range(num_new):
            logits = hf_model(torch.tensor([tokens])).logits[0].float()
            tokens.append(int(logits[-1].argmax()))
        logits = hf_model(torch.tensor([tokens[:-1]])).logits[0].float()
    return tokens[len(prompt) :], logits
