"""Vocabulary-parallel token embedding and LM head.

Each rank holds a contiguous slice of the vocabulary's rows. The embedding looks up the ids it
owns (zeros elsewhere) and all-reduces; the head computes its slice of the logits and
all-gathers them, so every rank ends with the full [tokens, vocab] logits.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pd_cluster.models.layers import cpu_gemm
from pd_cluster.models.layers.tp import TPGroup


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup = TPGroup()) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.vocab_start, self.vocab_part = tp.split(vocab_size, "vocab_size")
        self.weight = nn.Parameter(torch.empty(self.vocab_part, hidden_size), requires_grad=False)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: Any = None) -> None:
        if loaded.shape[0] != self.vocab_size or loaded.shape[1] != param.shape[1]:
            raise ValueError(f"checkpoint embedding shape {tuple(loaded.shape)} does not match "
                             f"vocab_size={self.vocab_size}, hidden_size={param.shape[1]}")
        param.data.copy_(loaded.narrow(0, self.vocab_start, self.vocab_part))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        owned = (local >= 0) & (local < self.vocab_part)
        out = F.embedding(local.clamp(0, self.vocab_part - 1), self.weight)
        out = out * owned.unsqueeze(-1).to(out.dtype)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits = hidden @ W^T, W split by vocabulary rows; the slices are gathered. On CPU the
    weight may be stored transposed or (untied) packed after loading (cpu_gemm.py)."""

    cpu_gemm_layouts = ("transposed", "packed", "upcast")

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup = TPGroup()) -> None:
        super().__init__(vocab_size, hidden_size, tp)
        self.packed: torch.Tensor | None = None
        self.packed_cpp = False  # cpu_gemm.pack's

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        """Share the embedding's weight (tied embeddings); the checkpoint's lm_head is unused."""
        self.weight = embedding.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        logits = cpu_gemm.linear(hidden, self.weight, None, self.packed, self.packed_cpp)
        return self.tp.all_gather(logits, dim=-1)
