"""Mixtral: Mistral's attention, every layer's MLP a sparse MoE (softmax over the experts,
top-k, renormalised; weights kept in fp32 as HF does). Checkpoints name the block
``block_sparse_moe`` and the experts' projections ``w1`` (gate), ``w3`` (up), ``w2`` (down)."""
from __future__ import annotations

from typing import Any

from pd_cluster.models.families.common import dense_spec, layer_types
from pd_cluster.models.families.moe_common import with_moe
from pd_cluster.models.families.registry import register_family
from pd_cluster.models.layers.moe import MoESpec
from pd_cluster.models.layers.moe_experts import ExpertsSpec
from pd_cluster.models.layers.moe_router import RoutingSpec
from pd_cluster.models.spec import ModelSpec


def mixtral_moe(cfg: dict[str, Any]) -> MoESpec:
    e, k = int(cfg.get("num_local_experts", 8)), int(cfg.get("num_experts_per_tok", 2))
    return MoESpec(RoutingSpec("softmax", e, k, renormalize=True),
                   ExpertsSpec(e, cfg["hidden_size"], cfg["intermediate_size"],
                               cfg.get("hidden_act", "silu")))


@register_family("MixtralForCausalLM")
def mixtral(cfg: dict[str, Any]) -> ModelSpec:
    kind = "sliding_attention" if cfg.get("sliding_window") else "full_attention"
    spec = dense_spec(cfg, types=layer_types(cfg, lambda i: kind), qkv_bias=False,
                      o_bias=False, activation=cfg.get("hidden_act", "silu"))
    return with_moe(spec, mixtral_moe(cfg), lambda i: True)
