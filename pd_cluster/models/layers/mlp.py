"""Feed-forward blocks, built by ``kind`` from a registry (another block, e.g. MoE, registers
its builder here and its family reader names it in ``MLPSpec.kind``)."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pd_cluster.models.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from pd_cluster.models.layers.tp import TPGroup
from pd_cluster.models.spec import ModelSpec

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}

MLPBuilder = Callable[[ModelSpec, int, TPGroup], nn.Module]
_MLPS: dict[str, MLPBuilder] = {}


def register_mlp(kind: str) -> Callable[[MLPBuilder], MLPBuilder]:
    def wrap(builder: MLPBuilder) -> MLPBuilder:
        _MLPS[kind] = builder
        return builder
    return wrap


def build_mlp(model: ModelSpec, layer_idx: int, tp: TPGroup) -> nn.Module:
    kind = model.layers[layer_idx].mlp.kind
    if kind not in _MLPS:
        raise ValueError(f"mlp kind {kind!r} is not supported (registered: {sorted(_MLPS)})")
    return _MLPS[kind](model, layer_idx, tp)


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in ACTIVATIONS:
        raise ValueError(f"hidden_act {name!r} is not supported (supported: {sorted(ACTIVATIONS)})")
    return ACTIVATIONS[name]


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)); gate and up in one column-parallel matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str, bias: bool,
                 tp: TPGroup = TPGroup()) -> None:
        super().__init__()
        self.act = activation(act)
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2,
                                                       bias=bias, tp=tp)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, tp=tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


@register_mlp("gated")
def _gated(model: ModelSpec, layer_idx: int, tp: TPGroup) -> nn.Module:
    m = model.layers[layer_idx].mlp
    return GatedMLP(model.hidden_size, m.intermediate_size, m.activation, m.bias, tp)
