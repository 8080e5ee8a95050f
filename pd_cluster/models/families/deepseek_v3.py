"""DeepSeek-V3 (and V2's layout): multi-head latent attention (layers/mla.py) in every layer,
a dense MLP below ``first_k_dense_replace`` then DeepSeek's MoE (deepseek_v3_moe.py).

The softmax scale is HF's: qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 when the
RoPE is scaled and ``mscale_all_dim`` is set (yarn's attention factor on cos/sin is rotary.py's).
"""
from __future__ import annotations

import math
from typing import Any

from pd_cluster.models.families.common import reject_unsupported
from pd_cluster.models.families.deepseek_v3_moe import deepseek_v3_moe, deepseek_v3_sparse
from pd_cluster.models.families.moe_common import moe_mlp
from pd_cluster.models.families.registry import register_family
from pd_cluster.models.layers import mla  # noqa: F401 - registers attention kind "latent"
from pd_cluster.models.layers.rotary import RopeSpec, read_rope
from pd_cluster.models.spec import AttentionSpec, LatentSpec, LayerSpec, MLPSpec, ModelSpec


def _mscale(scale: float, m: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def softmax_scale(latent: LatentSpec, rope: RopeSpec) -> float:
    scale = latent.qk_head_dim ** -0.5
    m_all = rope.params.get("mscale_all_dim")
    if rope.rope_type != "default" and m_all:
        m = _mscale(float(rope.params["factor"]), float(m_all))
        scale *= m * m
    return scale


def latent_spec(cfg: dict[str, Any]) -> LatentSpec:
    q_rank = cfg.get("q_lora_rank")
    return LatentSpec(None if q_rank is None else int(q_rank), int(cfg["kv_lora_rank"]),
                      int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"]),
                      int(cfg["v_head_dim"]), bool(cfg.get("rope_interleave", True)))


@register_family("DeepseekV3ForCausalLM")
def deepseek_v3(cfg: dict[str, Any]) -> ModelSpec:
    reject_unsupported(cfg)
    latent = latent_spec(cfg)
    rope = read_rope(cfg, latent.qk_rope_head_dim)  # only the rope dims rotate
    bias = bool(cfg.get("attention_bias", False))
    attn = AttentionSpec(cfg["num_attention_heads"], 1, latent.qk_head_dim, rope,
                         softmax_scale(latent, rope), qkv_bias=bias, o_bias=bias,
                         kind="latent", latent=latent)
    act = cfg.get("hidden_act", "silu")
    n = cfg["num_hidden_layers"]
    mtp = int(cfg.get("num_nextn_predict_layers") or 0)  # served without speculation
    dense = MLPSpec(cfg["intermediate_size"], act)
    sparse = moe_mlp(deepseek_v3_moe(cfg))
    layers = tuple(LayerSpec(attn, sparse if deepseek_v3_sparse(cfg, i) else dense)
                   for i in range(n))
    return ModelSpec(
        architecture="DeepseekV3ForCausalLM", vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"], rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)), layers=layers,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        skipped_weights=tuple(f"model.layers.{n + i}." for i in range(mtp)))
