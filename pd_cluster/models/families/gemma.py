"""Gemma 2 and Gemma 3 (text): sandwich norms scaled by (1 + weight), GELU-tanh MLP,
embeddings times sqrt(hidden), query_pre_attn_scalar, local (sliding) and global layers.
Gemma 2 soft-caps attention and final logits; Gemma 3 normalises q/k per head and gives
local layers their own RoPE base."""
from __future__ import annotations

from typing import Any

from pd_cluster.models.families.common import dense_spec, head_dim, layer_types
from pd_cluster.models.families.registry import register_family
from pd_cluster.models.layers.rotary import read_rope
from pd_cluster.models.spec import SANDWICH_NORM, ModelSpec


def _gemma_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    return dict(qkv_bias=bool(cfg.get("attention_bias", False)),
                o_bias=bool(cfg.get("attention_bias", False)),
                activation=cfg.get("hidden_activation") or cfg.get("hidden_act")
                or "gelu_pytorch_tanh",
                scale=float(cfg.get("query_pre_attn_scalar") or head_dim(cfg)) ** -0.5,
                logit_softcap=cfg.get("attn_logit_softcapping"), norms=SANDWICH_NORM,
                norm="gemma", embed_scale=True,
                final_logit_softcap=cfg.get("final_logit_softcapping"))


@register_family("Gemma2ForCausalLM")
def gemma2(cfg: dict[str, Any]) -> ModelSpec:
    types = layer_types(cfg, lambda i: "sliding_attention" if i % 2 == 0 else "full_attention")
    return dense_spec(cfg, types=types, **_gemma_fields(cfg))


@register_family("Gemma3ForCausalLM")
def gemma3(cfg: dict[str, Any]) -> ModelSpec:
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention True is not supported (causal LMs only)")
    pattern = cfg.get("sliding_window_pattern", 6)
    types = layer_types(cfg, lambda i: "sliding_attention" if (i + 1) % pattern
                        else "full_attention")
    hd = head_dim(cfg)
    # transformers 4 configs: rope_theta/rope_scaling are the global layers', local layers
    # have rope_local_base_freq; transformers 5 nests both under rope_parameters.
    local_cfg = dict(cfg, rope_theta=cfg.get("rope_local_base_freq", 10000.0))
    ropes = {"full_attention": read_rope(cfg, hd, "full_attention", default_theta=1e6),
             "sliding_attention": read_rope(local_cfg, hd, "sliding_attention",
                                            legacy_scaling=False)}
    return dense_spec(cfg, types=types, rope_of=ropes.__getitem__, qk_norm="head",
                      **_gemma_fields(cfg))
