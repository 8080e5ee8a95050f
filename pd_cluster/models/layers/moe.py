"""A sparse mixture-of-experts feed-forward block: router, routed experts, optional shared
experts (DeepSeek-V3), one all-reduce over the tensor-parallel group.

Module names follow the checkpoints (``mlp.gate`` / gpt-oss's ``mlp.router``, ``mlp.experts``,
``mlp.shared_experts``); ``checkpoint_target`` maps a checkpoint tensor name to the parameter
and shard id its weight loader takes (per-expert tensors go into the stacked expert weights).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from pd_cluster.models.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from pd_cluster.models.layers.mlp import register_mlp
from pd_cluster.models.layers.moe_experts import ExpertsSpec, MoEExperts, gated_activation
from pd_cluster.models.layers.moe_router import Router, RoutingSpec
from pd_cluster.models.layers.tp import TPGroup
from pd_cluster.models.spec import ModelSpec


@dataclass(frozen=True)
class MoESpec:
    routing: RoutingSpec
    experts: ExpertsSpec
    router_name: str = "gate"  # "router" in gpt-oss checkpoints
    shared_intermediate_size: int = 0  # DeepSeek-V3: moe_intermediate_size * n_shared_experts

    def __post_init__(self) -> None:
        if self.routing.num_experts != self.experts.num_experts:
            raise ValueError(f"router has {self.routing.num_experts} experts, experts "
                             f"{self.experts.num_experts}")
        if self.router_name not in ("gate", "router"):
            raise ValueError(f"router_name {self.router_name!r} is not 'gate' or 'router'")


class SharedExperts(nn.Module):
    """Experts every token goes through (DeepSeek-V3), split like a dense gated MLP (the
    checkpoint's ``gate_proj``/``up_proj``/``down_proj`` load through linear.py's layers), but
    returning this rank's partial sum so the block all-reduces once."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str, tp: TPGroup) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2,
                                                       tp=tp)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, tp=tp)
        self.act = gated_activation(ExpertsSpec(1, hidden_size, intermediate_size, act))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.partial(self.act(self.gate_up_proj(x)))


class SparseMoE(nn.Module):
    def __init__(self, spec: MoESpec, tp: TPGroup = TPGroup(),
                 fused: Callable[..., torch.Tensor] | None = None) -> None:
        super().__init__()
        self.spec, self.tp, self.fused = spec, tp, fused
        self.add_module(spec.router_name, Router(spec.experts.hidden_size, spec.routing))
        self.experts = MoEExperts(spec.experts, tp)
        self.shared_experts = (SharedExperts(spec.experts.hidden_size,
                                             spec.shared_intermediate_size,
                                             spec.experts.activation, tp)
                               if spec.shared_intermediate_size else None)

    @property
    def router_module(self) -> Router:
        """``self.gate`` (or gpt-oss's ``self.router``: the name its checkpoints use)."""
        return self._modules[self.spec.router_name]  # type: ignore[return-value]

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the output, before the all-reduce."""
        weights, ids = self.router_module(x)
        out = self.experts(x, weights, ids, self.fused)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        return self.tp.all_reduce(self.partial(x)).reshape(shape)


@register_mlp("moe")
def _build(model: ModelSpec, layer_idx: int, tp: TPGroup) -> nn.Module:
    return SparseMoE(model.layers[layer_idx].mlp.extra["moe"], tp)


_PER_EXPERT = re.compile(r"\.experts\.(\d+)\.(w1|w3|w2|gate_proj|up_proj|down_proj)\."
                         r"(weight|bias)$")
_PART = {"w1": 0, "gate_proj": 0, "w3": 1, "up_proj": 1}


def checkpoint_target(name: str, params: dict[str, Any]) -> tuple[str, Any] | None:
    """(parameter name, shard id) for an MoE checkpoint tensor, or None if it is not one.
    Mixtral's ``block_sparse_moe`` is our ``mlp``."""
    name = name.replace(".block_sparse_moe.", ".mlp.")
    m = _PER_EXPERT.search(name)
    if m:
        expert, proj, kind = int(m.group(1)), m.group(2), m.group(3)
        stem = name[:m.start()] + ".experts."
        suffix = "" if kind == "weight" else "_bias"
        if proj in _PART:
            target, shard = f"{stem}gate_up_proj{suffix}", (expert, _PART[proj])
        else:
            target, shard = f"{stem}down_proj{suffix}", expert
        return (target, shard) if target in params else None
    return (name, None) if name in params else None


def expected_shards(param_name: str, param: torch.Tensor) -> list[Any]:
    """The shard ids a per-expert checkpoint delivers to a stacked expert parameter (a fused
    checkpoint delivers it whole, shard id None, instead); [] for any other parameter."""
    if param_name.endswith((".experts.gate_up_proj", ".experts.gate_up_proj_bias")):
        return [(e, which) for e in range(param.shape[0]) for which in (0, 1)]
    if param_name.endswith((".experts.down_proj", ".experts.down_proj_bias")):
        return list(range(param.shape[0]))
    return []
