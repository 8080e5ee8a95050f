"""Config fields every dense family reads the same way."""
from __future__ import annotations

from typing import Any, Callable

from pd_cluster.models.layers.rotary import RopeSpec, read_rope
from pd_cluster.models.quant import quant_format
from pd_cluster.models.spec import AttentionSpec, LayerSpec, MLPSpec, ModelSpec

LAYER_TYPES = ("full_attention", "sliding_attention")


def reject_unsupported(cfg: dict[str, Any]) -> None:
    quant_format(cfg)  # a quantization_config the loader cannot dequantise: one-line error


def head_dim(cfg: dict[str, Any]) -> int:
    return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])


def layer_types(cfg: dict[str, Any], default: Callable[[int], str]) -> list[str]:
    """Per layer "full_attention" or "sliding_attention": the config's ``layer_types`` (as
    transformers 5 writes it), else the family's rule for older configs."""
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types") or [default(i) for i in range(n)]
    if len(types) != n:
        raise ValueError(f"layer_types has {len(types)} entries for num_hidden_layers={n}")
    for t in types:
        if t not in LAYER_TYPES:
            raise ValueError(f"layer_types entry {t!r} is not supported (supported: {LAYER_TYPES})")
    return list(types)


def window_of(cfg: dict[str, Any], layer_type: str) -> int | None:
    """The sliding window of a layer of this type; None for full attention (or a window no
    shorter than the model's positions, which masks nothing)."""
    window = cfg.get("sliding_window")
    if layer_type != "sliding_attention" or window is None:
        return None
    if window >= cfg.get("max_position_embeddings", 2048):
        return None
    return int(window)


def dense_spec(cfg: dict[str, Any], *, types: list[str], qkv_bias: bool, o_bias: bool,
               activation: str, rope_of: Callable[[str], RopeSpec] | None = None,
               scale: float | None = None, qk_norm: str | None = None,
               logit_softcap: float | None = None, **model_fields: Any) -> ModelSpec:
    """A ModelSpec of identical dense layers but for each layer type's window and RoPE."""
    reject_unsupported(cfg)
    hd = head_dim(cfg)
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    if rope_of is None:
        rope = read_rope(cfg, hd)
        rope_of = lambda _t: rope  # noqa: E731 - one RoPE for every layer
    mlp = MLPSpec(cfg["intermediate_size"], activation, bool(cfg.get("mlp_bias", False)))
    layers = tuple(
        LayerSpec(AttentionSpec(heads, kv_heads, hd, rope_of(t),
                                scale if scale is not None else hd ** -0.5,
                                qkv_bias=qkv_bias, o_bias=o_bias,
                                sliding_window=window_of(cfg, t), logit_softcap=logit_softcap,
                                qk_norm=qk_norm), mlp)
        for t in types)
    return ModelSpec(
        architecture=(cfg.get("architectures") or ["?"])[0], vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"], rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)), layers=layers,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), **model_fields)
