"""MoE routers: which ``top_k`` experts each token goes to, and with what weights.

Each family's routing is data (``RoutingSpec``), matching transformers' router of that family
step for step, dtypes included (they decide bf16 results):

- ``softmax`` (Mixtral, Qwen3-MoE): softmax over all experts in fp32, top-k, optionally
  renormalised over the k. Mixtral keeps the weights in fp32; Qwen3-MoE casts them back to
  the activation dtype (``weights_in_activation_dtype``).
- ``topk_softmax`` (gpt-oss): top-k of the biased logits, softmax over those k only, in the
  activation dtype.
- ``sigmoid`` (DeepSeek-V3): logits in fp32, sigmoid scores; the experts are *chosen* on
  scores + ``e_score_correction_bias`` restricted to the ``topk_group`` best of ``n_group``
  groups (a group scores the sum of its two best), but *weighted* by the plain scores,
  optionally renormalised, times ``routed_scaling_factor``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


SCORINGS = ("softmax", "topk_softmax", "sigmoid")


@dataclass(frozen=True)
class RoutingSpec:
    scoring: str
    num_experts: int
    top_k: int
    renormalize: bool = True
    weights_in_activation_dtype: bool = False
    router_bias: bool = False  # gpt-oss: ``router.bias``
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.scoring not in SCORINGS:
            raise ValueError(f"routing scoring {self.scoring!r} is not supported ({SCORINGS})")
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.top_k} must be in "
                             f"[1, num_experts={self.num_experts}]")
        if self.n_group < 1 or self.num_experts % self.n_group:
            raise ValueError(f"n_group={self.n_group} does not divide "
                             f"num_experts={self.num_experts}")
        if not 0 < self.topk_group <= self.n_group:
            raise ValueError(f"topk_group={self.topk_group} must be in [1, n_group={self.n_group}]")
        if self.scoring == "sigmoid" and self.n_group > 1:
            per_group, chosen = self.num_experts // self.n_group, self.topk_group
            if per_group < 2:  # a group scores the sum of its two best experts
                raise ValueError(f"n_group={self.n_group} leaves {per_group} expert per group; "
                                 f"group-limited routing needs at least 2")
            if per_group * chosen < self.top_k:
                raise ValueError(f"topk_group={chosen} groups of {per_group} experts hold fewer "
                                 f"than num_experts_per_tok={self.top_k}")


class Router(nn.Module):
    """The gate, replicated on every tensor-parallel rank (it is tiny, and every rank must
    route identically), so its parameters take linear.py's default loader. Names follow the
    checkpoints: ``weight``, gpt-oss's ``bias``, DeepSeek-V3's ``e_score_correction_bias``
    (a buffer in HF's module, a tensor in the file)."""

    def __init__(self, hidden_size: int, spec: RoutingSpec) -> None:
        super().__init__()
        self.spec = spec
        e = spec.num_experts
        self.weight = nn.Parameter(torch.empty(e, hidden_size), requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(e), requires_grad=False) if spec.router_bias
                     else None)
        self.e_score_correction_bias = (nn.Parameter(torch.empty(e), requires_grad=False)
                                        if spec.scoring == "sigmoid" else None)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (weights [T, top_k], expert ids [T, top_k] int64)."""
        s = self.spec
        if s.scoring == "sigmoid":
            return self._sigmoid(F.linear(x.float(), self.weight.float()))
        logits = F.linear(x, self.weight, self.bias)
        if s.scoring == "topk_softmax":
            top, ids = torch.topk(logits, s.top_k, dim=-1)
            return torch.softmax(top, dim=-1, dtype=top.dtype), ids
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, s.top_k, dim=-1)
        if s.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if s.weights_in_activation_dtype:
            weights = weights.to(logits.dtype)
        return weights, ids

    def _sigmoid(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.spec
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        if s.n_group > 1:
            grouped = choice.view(-1, s.n_group, s.num_experts // s.n_group)
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
            best = group_scores.topk(s.topk_group, dim=-1, sorted=False).indices
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
            choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).flatten(1)
        ids = choice.topk(s.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        if s.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * s.routed_scaling_factor, ids
