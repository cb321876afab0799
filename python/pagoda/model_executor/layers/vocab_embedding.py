"""Token embeddings and the LM head (vLLM's names; no vocab sharding yet)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.model_executor.layers.linear import dense
from pagoda.model_executor.weight_utils import new_parameter


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.weight = new_parameter(num_embeddings, embedding_dim, dtype=dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class ParallelLMHead(VocabParallelEmbedding):
    """hidden states -> vocabulary logits, with the weight layout of an embedding."""

    def tie_weights(self, embed_tokens: VocabParallelEmbedding) -> "ParallelLMHead":
        """Share the embedding's weight. The model registers its embedding
        first, so named_parameters() lists the shared weight under the
        embedding's name only (the one checkpoints of tied models carry)."""
        self.weight = embed_tokens.weight
        return self

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """float32 [N, vocab]: the matmul runs in the model's dtype (as in
        Hugging Face), the sampler gets fp32."""
        return dense(hidden_states, self.weight).float()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.compute_logits(hidden_states)
