"""Which slice of a tensor-parallel group this process holds, and the collectives layers use.

A model is built with a ``TPGroup``; at size 1 (the default) every collective is a no-op, so
the single-device engine runs exactly the code a tensor-parallel engine runs. The group is
passed down explicitly (no process-global "current rank"), so several engines, each with its
own group, can live in one process.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    group: Any = None  # a torch.distributed ProcessGroup (NCCL on GPUs, Gloo on CPUs); None at size 1

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor_parallel_size: rank {self.rank} of {self.size} is invalid")
        if self.size > 1 and self.group is None:
            raise ValueError("tensor_parallel_size > 1 needs a process group")

    def split(self, total: int, what: str) -> tuple[int, int]:
        """(start, length) of this rank's even share of ``total`` items of ``what``."""
        if total % self.size:
            raise ValueError(f"tensor_parallel_size={self.size} does not divide {what}={total}")
        part = total // self.size
        return self.rank * part, part

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks (row-parallel outputs): in place, or in a compiled graph through an
        opaque op (the engine's groups are built straight from a store, unnamed, which the
        traced functional collectives cannot address)."""
        if self.size == 1:
            return x
        if torch.compiler.is_compiling():
            return torch.ops.pd_cluster.tp_all_reduce(x)  # paged_call.py
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``x`` along ``dim`` (column-parallel outputs, logits)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)
