"""Build a model from a Hugging Face checkpoint directory (config.json + *.safetensors)."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_file
from torch import nn

from pd_cluster.models.llama import LlamaForCausalLM, ModelArgs, RotaryEmbedding

logger = logging.getLogger(__name__)

# Architecture name -> function reading its HF config into ModelArgs. All three share the
# Llama module tree; they differ in biases and defaults only.
_ARCHITECTURES: dict[str, Callable[[dict[str, Any]], ModelArgs]] = {}


def register_architecture(name: str) -> Callable:
    def wrap(fn: Callable[[dict[str, Any]], ModelArgs]) -> Callable[[dict[str, Any]], ModelArgs]:
        _ARCHITECTURES[name] = fn
        return fn
    return wrap


def _rope_theta(cfg: dict[str, Any]) -> float:
    # transformers 5 nests rope settings in rope_parameters; 4.x keeps rope_theta/rope_scaling.
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    rope_type = next((t for t in (scaling.get("rope_type"), scaling.get("type"), params.get("rope_type"))
                      if t not in (None, "default")), None)  # HF: a legacy rope_scaling wins
    if rope_type not in (None, "default"):
        raise ValueError(f"rope scaling type {rope_type!r} is not supported "
                         f"(only unscaled RoPE is implemented)")
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def _common_args(cfg: dict[str, Any], qkv_bias: bool) -> ModelArgs:
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported (only silu)")
    num_heads = cfg["num_attention_heads"]
    return ModelArgs(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"],
        num_heads=num_heads, num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=_rope_theta(cfg),
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias, o_bias=bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)))


def _no_sliding_window(cfg: dict[str, Any], enabled: bool) -> None:
    window = cfg.get("sliding_window")
    if enabled and window is not None and window < cfg.get("max_position_embeddings", 0):
        raise ValueError(f"sliding_window={window} attention is not supported")


@register_architecture("LlamaForCausalLM")
def _llama(cfg: dict[str, Any]) -> ModelArgs:
    return _common_args(cfg, qkv_bias=bool(cfg.get("attention_bias", False)))


@register_architecture("MistralForCausalLM")
def _mistral(cfg: dict[str, Any]) -> ModelArgs:
    _no_sliding_window(cfg, True)
    return _common_args(cfg, qkv_bias=False)


@register_architecture("Qwen2ForCausalLM")
def _qwen2(cfg: dict[str, Any]) -> ModelArgs:
    _no_sliding_window(cfg, bool(cfg.get("use_sliding_window", False)))
    return _common_args(cfg, qkv_bias=True)


def model_args_from_config(cfg: dict[str, Any]) -> ModelArgs:
    archs = cfg.get("architectures") or []
    supported = [a for a in archs if a in _ARCHITECTURES]
    if not supported:
        raise ValueError(f"architecture {archs or cfg.get('model_type')!r} is not supported; "
                         f"supported: {sorted(_ARCHITECTURES)}")
    return _ARCHITECTURES[supported[0]](cfg)


# Fused module -> the HF modules concatenated (in this order) along the output dim.
_FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def fuse_projections(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename HF q/k/v and gate/up weights (and biases) into our fused modules."""
    out = dict(state)
    for key in list(state):
        for fused, parts in _FUSED.items():
            marker = f".{parts[0]}."
            if marker not in key:
                continue
            prefix, suffix = key.split(marker)
            names = [f"{prefix}.{p}.{suffix}" for p in parts]
            if all(n in out for n in names):
                out[f"{prefix}.{fused}.{suffix}"] = torch.cat([out.pop(n) for n in names])
    return out


def load_model(model_dir: str, cfg: dict[str, Any], dtype: torch.dtype,
               device: torch.device) -> nn.Module:
    args = model_args_from_config(cfg)
    with torch.device("meta"):
        model = LlamaForCausalLM(args)
    state: dict[str, torch.Tensor] = {}
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors files in {model_dir!r}")
    for f in files:
        state.update(load_file(str(f)))
    if args.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    state = fuse_projections(state)
    expected = {k for k in model.state_dict() if not (args.tie_word_embeddings and k == "lm_head.weight")}
    missing, unexpected = expected - set(state), set(state) - expected
    unexpected = {k for k in unexpected if "rotary_emb" not in k}
    if missing or unexpected:
        raise ValueError(f"checkpoint {model_dir!r} does not match {cfg.get('architectures')}: "
                         f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    model = model.to_empty(device=device)
    model.load_state_dict({k: v for k, v in state.items() if k in expected}, strict=False)
    if args.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model = model.to(dtype)
    # Rotary tables are buffers, not weights: rebuild them in fp32 on the real device after
    # the dtype cast (as HF does, cos/sin are computed in fp32 and cast per use).
    rotary = RotaryEmbedding(args.head_dim, args.rope_theta, args.max_position_embeddings).to(device)
    for layer in model.model.layers:
        layer.self_attn.rotary = rotary
    logger.info("loaded %s: %d layers, hidden %d, heads %d/%d, %.1fM params, %s on %s",
                cfg.get("architectures"), args.num_layers, args.hidden_size, args.num_heads,
                args.num_kv_heads, sum(p.numel() for p in model.parameters()) / 1e6, dtype, device)
    return model.eval()
