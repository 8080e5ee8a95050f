"""Llama (1-3.x), Mistral and Qwen2: pre-norm SiLU decoders differing in biases and windows."""
from __future__ import annotations

from typing import Any

from pd_cluster.models.families.common import dense_spec, layer_types
from pd_cluster.models.families.registry import register_family
from pd_cluster.models.spec import ModelSpec


def _act(cfg: dict[str, Any]) -> str:
    return cfg.get("hidden_act", "silu")


@register_family("LlamaForCausalLM")
def llama(cfg: dict[str, Any]) -> ModelSpec:
    bias = bool(cfg.get("attention_bias", False))
    return dense_spec(cfg, types=layer_types(cfg, lambda i: "full_attention"), qkv_bias=bias,
                      o_bias=bias, activation=_act(cfg))


@register_family("MistralForCausalLM")
def mistral(cfg: dict[str, Any]) -> ModelSpec:
    # Every layer uses the window when one is set (HF Mistral has no per-layer types).
    kind = "sliding_attention" if cfg.get("sliding_window") else "full_attention"
    return dense_spec(cfg, types=layer_types(cfg, lambda i: kind), qkv_bias=False,
                      o_bias=False, activation=_act(cfg))


def qwen_layer_types(cfg: dict[str, Any]) -> list[str]:
    """Qwen2/Qwen3: with use_sliding_window, layers from max_window_layers on use the window."""
    on, first = bool(cfg.get("use_sliding_window")), cfg.get("max_window_layers", 0)
    return layer_types(cfg, lambda i: "sliding_attention" if on and i >= first
                       else "full_attention")


@register_family("Qwen2ForCausalLM")
def qwen2(cfg: dict[str, Any]) -> ModelSpec:
    return dense_spec(cfg, types=qwen_layer_types(cfg), qkv_bias=True, o_bias=False,
                      activation=_act(cfg))
