"""gpt-oss: attention with q/k/v/o biases and a learned sink logit per head, alternating
sliding and full layers, yarn RoPE; every MLP a sparse MoE routed on the top-k of the
biased router logits (softmax over those k), experts with biases and the clamped SwiGLU
``(clamp(up) + 1) * g * sigmoid(alpha * g)``, g = gate clamped above at ``swiglu_limit``.
Checkpoints hold the experts fused: ``gate_up_proj`` [E, H, 2I] with gate and up interleaved.
Released MXFP4 checkpoints (``quantization_config``) dequantise on load (models/quant/
mxfp4.py) into these fused expert tensors."""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from pd_cluster.models.families.common import dense_spec, layer_types
from pd_cluster.models.families.moe_common import with_moe
from pd_cluster.models.families.registry import register_family
from pd_cluster.models.layers.moe import MoESpec
from pd_cluster.models.layers.moe_experts import ExpertsSpec
from pd_cluster.models.layers.moe_router import RoutingSpec
from pd_cluster.models.spec import ModelSpec


def gpt_oss_moe(cfg: dict[str, Any]) -> MoESpec:
    e, k = int(cfg.get("num_local_experts", 128)), int(cfg.get("num_experts_per_tok", 4))
    return MoESpec(RoutingSpec("topk_softmax", e, k, router_bias=True),
                   ExpertsSpec(e, cfg["hidden_size"], cfg["intermediate_size"],
                               "swiglu_clamped", bias=True,
                               swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
                               swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
                               fused_layout="gpt_oss"),
                   router_name="router")


@register_family("GptOssForCausalLM")
def gpt_oss(cfg: dict[str, Any]) -> ModelSpec:
    types = layer_types(cfg, lambda i: "sliding_attention" if (i + 1) % 2 else "full_attention")
    bias = bool(cfg.get("attention_bias", True))
    spec = dense_spec(cfg, types=types, qkv_bias=bias, o_bias=bias, activation="silu")
    spec = replace(spec, layers=tuple(replace(layer, attention=replace(layer.attention,
                                                                       sinks=True))
                                      for layer in spec.layers))
    return with_moe(spec, gpt_oss_moe(cfg), lambda i: True)
