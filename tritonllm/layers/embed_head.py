"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous slice of the vocabulary."""
import torch
import torch.nn.functional as F
from torch import nn

from tritonllm.distributed import all_reduce, gather_last_dim, tp_rank, tp_size
from tritonllm.layers.linear import check_shape, narrow


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.rows = -(-vocab_size // tp_size())  # the last rank's slice is zero-padded
        self.start = tp_rank() * self.rows
        self.weight = nn.Parameter(torch.zeros(self.rows, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None):
        check_shape(loaded, (self.vocab_size, param.shape[1]))
        size = max(0, min(self.rows, self.vocab_size - self.start))
        param.data[:size].copy_(narrow(loaded, 0, self.start, size))

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if tp_size() == 1:
            return F.embedding(token_ids, self.weight)
        local = token_ids - self.start
        mine = (local >= 0) & (local < self.rows)
        x = F.embedding(local.clamp(0, self.rows - 1), self.weight) * mine.unsqueeze(-1)
        return all_reduce(x)


class ParallelLMHead(VocabParallelEmbedding):
    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits [N, V] on rank 0 (None on the others) for the N rows of `hidden`."""
        logits = gather_last_dim(F.linear(hidden, self.weight))
        return None if logits is None else logits[..., : self.vocab_size]
