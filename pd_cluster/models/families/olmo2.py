"""OLMo 2: norms after each sublayer (before the residual add, none before), RMSNorm of the
whole q and k projections (not per head), norms scaling in fp32 before rounding."""
from __future__ import annotations

from typing import Any

from pd_cluster.models.families.common import dense_spec
from pd_cluster.models.families.registry import register_family
from pd_cluster.models.spec import POST_NORM, ModelSpec


@register_family("Olmo2ForCausalLM")
def olmo2(cfg: dict[str, Any]) -> ModelSpec:
    bias = bool(cfg.get("attention_bias", False))
    return dense_spec(cfg, types=["full_attention"] * cfg["num_hidden_layers"], qkv_bias=bias,
                      o_bias=bias, activation=cfg.get("hidden_act", "silu"), qk_norm="proj",
                      norms=POST_NORM, norm="scaled")
