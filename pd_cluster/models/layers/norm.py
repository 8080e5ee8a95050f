"""RMSNorm as the families define it (``kind``, statistics always in fp32):

- ``llama``: cast the normalised value to the activation dtype, then multiply by the weight;
- ``scaled``: multiply by the weight in fp32, then cast (OLMo 2, gpt-oss);
- ``gemma``: multiply by ``1 + weight`` (weights stored around 0) in fp32, then cast.

The orders differ only in low precision, but matching HF there keeps bf16 runs identical.

``ShardedRMSNorm`` normalises over a dimension that tensor parallelism splits (OLMo 2's q/k
norm over the whole projection): the mean of squares is all-reduced over ranks.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pd_cluster.models.layers.tp import TPGroup


NORM_KINDS = ("llama", "scaled", "gemma")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, kind: str = "llama") -> None:
        super().__init__()
        if kind not in NORM_KINDS:
            raise ValueError(f"norm kind {kind!r} is not supported (supported: {NORM_KINDS})")
        self.eps, self.kind = eps, kind
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)

    def _scale(self, x: torch.Tensor, mean_sq: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        x = x * torch.rsqrt(mean_sq + self.eps)
        if self.kind == "gemma":
            return (x * (1.0 + self.weight.float())).to(dtype)
        if self.kind == "scaled":
            return (self.weight.float() * x).to(dtype)
        return self.weight * x.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype, x = x.dtype, x.float()  # statistics in fp32, as HF computes them
        return self._scale(x, x.pow(2).mean(-1, keepdim=True), dtype)


class ShardedRMSNorm(RMSNorm):
    """RMSNorm over ``total_dim`` features of which this rank holds a contiguous slice."""

    def __init__(self, total_dim: int, eps: float, tp: TPGroup = TPGroup(),
                 kind: str = "llama") -> None:
        _, part = tp.split(total_dim, "normalised features")
        super().__init__(part, eps, kind)
        self.tp, self.total_dim = tp, total_dim

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: Any = None) -> None:
        part = param.shape[0]
        param.data.copy_(loaded.narrow(0, self.tp.rank * part, part))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype, x = x.dtype, x.float()
        sum_sq = self.tp.all_reduce(x.pow(2).sum(-1, keepdim=True))
        return self._scale(x, sum_sq / self.total_dim, dtype)
