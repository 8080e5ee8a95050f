"""Qwen3-MoE: Qwen3's attention (q/k RMSNorm per head); layer i is sparse unless it is in
``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0`` (then a dense MLP of
``intermediate_size``). Routing: softmax, top-k, renormalised only with ``norm_topk_prob``,
weights cast back to the activation dtype."""
from __future__ import annotations

from typing import Any

from pd_cluster.models.families.common import dense_spec, layer_types
from pd_cluster.models.families.moe_common import with_moe
from pd_cluster.models.families.registry import register_family
from pd_cluster.models.layers.moe import MoESpec
from pd_cluster.models.layers.moe_experts import ExpertsSpec
from pd_cluster.models.layers.moe_router import RoutingSpec
from pd_cluster.models.spec import ModelSpec


def _num_experts(cfg: dict[str, Any]) -> int:
    """Qwen's configs say ``num_experts``; transformers 5 writes ``num_local_experts``."""
    return int(cfg.get("num_experts", cfg.get("num_local_experts", 128)))


def qwen3_moe_moe(cfg: dict[str, Any]) -> MoESpec:
    e, k = _num_experts(cfg), int(cfg.get("num_experts_per_tok", 8))
    return MoESpec(RoutingSpec("softmax", e, k, renormalize=bool(cfg.get("norm_topk_prob")),
                               weights_in_activation_dtype=True),
                   ExpertsSpec(e, cfg["hidden_size"], cfg["moe_intermediate_size"],
                               cfg.get("hidden_act", "silu")))


def qwen3_moe_sparse(cfg: dict[str, Any], i: int) -> bool:
    step = int(cfg.get("decoder_sparse_step", 1))
    return (i not in (cfg.get("mlp_only_layers") or []) and _num_experts(cfg) > 0
            and (i + 1) % step == 0)


@register_family("Qwen3MoeForCausalLM")
def qwen3_moe(cfg: dict[str, Any]) -> ModelSpec:
    # HF's config drops the window unless use_sliding_window; then every layer uses it.
    windowed = cfg.get("use_sliding_window") and cfg.get("sliding_window")
    kind = "sliding_attention" if windowed else "full_attention"
    bias = bool(cfg.get("attention_bias", False))
    spec = dense_spec(cfg, types=layer_types(cfg, lambda i: kind), qkv_bias=bias, o_bias=bias,
                      activation=cfg.get("hidden_act", "silu"), qk_norm="head")
    return with_moe(spec, qwen3_moe_moe(cfg), lambda i: qwen3_moe_sparse(cfg, i))
