"""Token embedding and LM head split over TP ranks along the vocabulary."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from bastion.core.models.layers.quantization import UNQUANTIZED, LinearMethod
from bastion.ops.communicator import get_tp_group
from torch import nn


class VocabParallelEmbedding(nn.Module):
    """Rank r holds vocabulary rows ``[r * per_rank, (r + 1) * per_rank)``; the last rank's
    slice is zero-padded when the vocabulary does not divide evenly."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.tp = get_tp_group()
        self.num_embeddings = num_embeddings
        self.num_embeddings_per_partition = -(-num_embeddings // self.tp.world_size)
        self.vocab_start = self.tp.rank * self.num_embeddings_per_partition
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        if loaded.shape[0] != self.num_embeddings:
            raise ValueError(f"embedding has {loaded.shape[0]} rows; the config says "
                             f"vocab_size={self.num_embeddings}")
        rows = loaded[self.vocab_start: self.vocab_start + param.shape[0]]
        param.data.zero_()
        param.data[: rows.shape[0]].copy_(rows)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings_per_partition)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection to the vocabulary; ``tie_to`` shares the embedding's weight (a
    quantized ``quant_method`` then holds its own copy for the matmul)."""

    quant_method: LinearMethod = UNQUANTIZED

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] -> [N, vocab] in the model's dtype, gathered over TP ranks, padding columns
        dropped. The sampler computes in float32; a plain argmax reads these directly (the
        float32 copy of a 256 x 152k batch costs a 0.1 ms kernel a step on an H200)."""
        logits = self.quant_method.apply(self, hidden)
        logits = self.tp.all_gather(logits, dim=-1)
        return logits[:, : self.num_embeddings]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.compute_logits(hidden)
