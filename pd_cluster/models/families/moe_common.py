"""What MoE families share: putting a family's MoE block into the layers that have one."""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

from pd_cluster.models.layers.moe import MoESpec
from pd_cluster.models.spec import MLPSpec, ModelSpec


def moe_mlp(moe: MoESpec) -> MLPSpec:
    """The ``MLPSpec`` of a layer whose feed-forward is ``moe`` (built by layers/moe.py)."""
    e = moe.experts
    return MLPSpec(e.intermediate_size, e.activation, e.bias, kind="moe", extra={"moe": moe})


def with_moe(spec: ModelSpec, moe: MoESpec, sparse: Callable[[int], bool]) -> ModelSpec:
    """``spec`` with the MLP of every layer ``i`` where ``sparse(i)`` replaced by ``moe``
    (the others keep the dense MLP the reader built)."""
    mlp = moe_mlp(moe)
    layers = tuple(replace(layer, mlp=mlp) if sparse(i) else layer
                   for i, layer in enumerate(spec.layers))
    return replace(spec, layers=layers)
