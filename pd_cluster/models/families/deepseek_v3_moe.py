"""DeepSeek-V3's MoE layer (its latent attention is not here yet, so the architecture is not
registered): sigmoid routing with the score-correction bias for choosing, group-limited
top-k, ``routed_scaling_factor``, shared experts; layers below ``first_k_dense_replace``
are dense."""
from __future__ import annotations

from typing import Any

from pd_cluster.models.layers.moe import MoESpec
from pd_cluster.models.layers.moe_experts import ExpertsSpec
from pd_cluster.models.layers.moe_router import RoutingSpec


def deepseek_v3_moe(cfg: dict[str, Any]) -> MoESpec:
    e = int(cfg.get("n_routed_experts", cfg.get("num_local_experts", 256)))
    inter = int(cfg.get("moe_intermediate_size", 2048))
    routing = RoutingSpec("sigmoid", e, int(cfg.get("num_experts_per_tok", 8)),
                          renormalize=bool(cfg.get("norm_topk_prob", True)),
                          n_group=int(cfg.get("n_group", 8) or 1),
                          topk_group=int(cfg.get("topk_group", 4) or 1),
                          routed_scaling_factor=float(cfg.get("routed_scaling_factor", 2.5)))
    return MoESpec(routing, ExpertsSpec(e, cfg["hidden_size"], inter,
                                        cfg.get("hidden_act", "silu")),
                   shared_intermediate_size=inter * int(cfg.get("n_shared_experts", 1) or 0))


def deepseek_v3_sparse(cfg: dict[str, Any], i: int) -> bool:
    return i >= int(cfg.get("first_k_dense_replace", 3))
