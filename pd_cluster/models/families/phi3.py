"""Phi-3: the Llama layer with q/k/v and gate/up stored fused in the checkpoint (they load
through the same fused-layer loaders), partial rotary and longrope scaling via RoPE data, and
an optional window on every layer."""
from __future__ import annotations

from typing import Any

from pd_cluster.models.families.common import dense_spec, layer_types
from pd_cluster.models.families.registry import register_family
from pd_cluster.models.spec import ModelSpec


@register_family("Phi3ForCausalLM")
def phi3(cfg: dict[str, Any]) -> ModelSpec:
    kind = "sliding_attention" if cfg.get("sliding_window") else "full_attention"
    bias = bool(cfg.get("attention_bias", False))
    return dense_spec(cfg, types=layer_types(cfg, lambda i: kind), qkv_bias=bias, o_bias=bias,
                      activation=cfg.get("hidden_act", "silu"))
