"""RMSNorm as the families define it.

``unit_offset``: Gemma scales by ``1 + weight`` (weights stored around 0) and multiplies in
fp32 before casting back; Llama-style casts the normalised value first, then multiplies. The
two orders differ only in low precision, but matching HF there keeps bf16 runs identical.

``ShardedRMSNorm`` normalises over a dimension that tensor parallelism splits (OLMo 2's q/k
norm over the whole projection): the mean of squares is all-reduced over ranks.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pd_cluster.models.layers.tp import TPGroup


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.eps, self.unit_offset = eps, unit_offset
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)

    def _scale(self, x: torch.Tensor, mean_sq: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        x = x * torch.rsqrt(mean_sq + self.eps)
        if self.unit_offset:
            return (x * (1.0 + self.weight.float())).to(dtype)
        return self.weight * x.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype, x = x.dtype, x.float()  # statistics in fp32, as HF computes them
        return self._scale(x, x.pow(2).mean(-1, keepdim=True), dtype)


class ShardedRMSNorm(RMSNorm):
    """RMSNorm over ``total_dim`` features of which this rank holds a contiguous slice."""

    def __init__(self, total_dim: int, eps: float, tp: TPGroup = TPGroup()) -> None:
        _, part = tp.split(total_dim, "normalised features")
        super().__init__(part, eps)
        self.tp, self.total_dim = tp, total_dim

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: Any = None) -> None:
        part = param.shape[0]
        param.data.copy_(loaded.narrow(0, self.tp.rank * part, part))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype, x = x.dtype, x.float()
        sum_sq = self.tp.all_reduce(x.pow(2).sum(-1, keepdim=True))
        return self._scale(x, sum_sq / self.total_dim, dtype)
