"""Token embeddings and the LM head (vLLM's names), split over the vocabulary
for tensor parallelism.

With tp ranks the vocabulary is padded to a multiple of 64 * tp (so it always
divides, and every rank's slice stays aligned for the GEMM) and rank r holds
rows [r * V / tp, (r + 1) * V / tp) of the padded table; padding rows are
zero. The embedding looks up the ids in its slice, zeroes the rest and
all-reduces (exactly one rank contributes each row); the LM head computes the
logits of its slice, all-gathers them and cuts the padding off. With one rank
nothing is padded and no collective runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagoda import ops
from pagoda.distributed.communication_op import tensor_model_parallel_all_gather, tensor_model_parallel_all_reduce
from pagoda.distributed.parallel_state import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from pagoda.model_executor.layers.linear import dense
from pagoda.model_executor.weight_utils import check_shape, default_weight_loader, new_parameter

PADDING_MULTIPLE = 64


def pad_vocab_size(vocab_size: int, tp_size: int) -> int:
    if tp_size == 1:
        return vocab_size
    multiple = PADDING_MULTIPLE * tp_size
    return -(-vocab_size // multiple) * multiple


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.tp_rank, self.tp_size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        self.num_embeddings_padded = pad_vocab_size(num_embeddings, self.tp_size)
        self.num_embeddings_per_partition = self.num_embeddings_padded // self.tp_size
        self.vocab_start_index = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end_index = self.vocab_start_index + self.num_embeddings_per_partition
        self.weight = new_parameter(
            self.num_embeddings_per_partition, embedding_dim, dtype=dtype, weight_loader=self.weight_loader
        )
        self.weight.full_shape = (num_embeddings, embedding_dim)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        check_shape(param.full_shape, loaded_weight)
        # The last ranks' slices run into the padding (a tiny vocabulary may
        # leave a rank none of the real rows).
        start = min(self.vocab_start_index, self.num_embeddings)
        real = min(self.vocab_end_index, self.num_embeddings) - start
        default_weight_loader(param[:real], loaded_weight.narrow(0, start, real))
        param.data[real:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        gguf_type = getattr(self.weight, "gguf_type", None)
        if gguf_type is not None:  # GGUF blocks (one rank): decode the looked-up rows only
            return ops.gguf_embedding(input_ids, self.weight, gguf_type, self.embedding_dim,
                                      panels=getattr(self.weight, "gguf_quantize_input", False))
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        in_slice = (input_ids >= self.vocab_start_index) & (input_ids < self.vocab_end_index)
        embeddings = F.embedding(torch.where(in_slice, input_ids - self.vocab_start_index, 0), self.weight)
        embeddings.masked_fill_(~in_slice.unsqueeze(-1), 0)
        return tensor_model_parallel_all_reduce(embeddings)


class ParallelLMHead(VocabParallelEmbedding):
    """hidden states -> vocabulary logits, with the weight layout of an embedding."""

    def tie_weights(self, embed_tokens: VocabParallelEmbedding) -> "ParallelLMHead":
        """Share the embedding's weight (split the same way: same vocabulary
        and world). The model registers its embedding first, so
        named_parameters() lists the shared weight under the embedding's name
        only (the one checkpoints of tied models carry)."""
        self.weight = embed_tokens.weight
        return self

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, vocab] as the matmul gives them, in the model's dtype (as in
        Hugging Face). The sampler widens them to float32 only where it
        computes on them (a widened copy of 256 rows of a 128k vocabulary is
        a 131 MB pass: 0.1 ms of an H200 decode step)."""
        logits = dense(hidden_states, self.weight)
        if self.tp_size == 1:
            return logits
        logits = tensor_model_parallel_all_gather(logits)[..., : self.num_embeddings]
        return logits.contiguous()  # rows of exactly vocab_size (one copy, if any)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.compute_logits(hidden_states)
