"""Qwen3: Qwen2 without q/k/v biases, plus RMSNorm of q and k per head before RoPE."""
from __future__ import annotations

from typing import Any

from pd_cluster.models.families.common import dense_spec
from pd_cluster.models.families.llama import qwen_layer_types
from pd_cluster.models.families.registry import register_family
from pd_cluster.models.spec import ModelSpec


@register_family("Qwen3ForCausalLM")
def qwen3(cfg: dict[str, Any]) -> ModelSpec:
    bias = bool(cfg.get("attention_bias", False))
    return dense_spec(cfg, types=qwen_layer_types(cfg), qkv_bias=bias, o_bias=bias,
                      activation=cfg.get("hidden_act", "silu"), qk_norm="head")
