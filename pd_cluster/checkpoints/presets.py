"""The named model presets (sizes and config overrides per family) and where the trained ones
ship: ``make-model --preset NAME`` and ``default_model_path(NAME)`` (maker.py) read these.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    # The built-in default: trained (scripts/train_tiny_model.py) and shipped, not generated;
    # these are its sizes (make-model --preset tiny-llama gives random weights of this shape).
    "tiny-llama": {"arch": "llama", "vocab_size": 1024, "hidden_size": 128, "num_layers": 4,
                   "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 256},
    "tiny-random-llama": {"arch": "llama"},
    "tiny-qwen2": {"arch": "qwen2"},
    "tiny-mistral": {"arch": "mistral"},
    # One per served family, each exercising what sets it apart, at the default
    # tiny size: windows shorter than test prompts, RoPE scalings, soft-caps, fused tensors.
    "tiny-llama3": {"arch": "llama", "config_overrides": {"rope_parameters": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256, "rope_theta": 500000.0}}},
    "tiny-qwen3": {"arch": "qwen3"},
    "tiny-qwen2-window": {"arch": "qwen2", "config_overrides": {
        "use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1}},
    "tiny-mistral-window": {"arch": "mistral", "config_overrides": {"sliding_window": 24}},
    "tiny-gemma2": {"arch": "gemma2", "config_overrides": {
        "sliding_window": 16, "attn_logit_softcapping": 4.0, "final_logit_softcapping": 30.0}},
    "tiny-gemma3": {"arch": "gemma3", "tie_word_embeddings": True, "config_overrides": {
        "sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                            "full_attention": {"rope_type": "linear", "factor": 2.0,
                                               "rope_theta": 1000000.0}}}},
    "tiny-phi3": {"arch": "phi3", "config_overrides": {"partial_rotary_factor": 0.5}},
    "tiny-phi3-longrope": {"arch": "phi3", "max_position_embeddings": 256, "config_overrides": {
        "original_max_position_embeddings": 32, "rope_parameters": {
            "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 32,
            "short_factor": [1.0, 1.1, 1.2, 1.3, 1.5, 2.0, 2.5, 3.0],
            "long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 9.0]}}},
    "tiny-olmo2": {"arch": "olmo2"},
    # DeepSeek-V3 in small: latent attention with q LoRA (a latent of 64 + a rope
    # key of 16 = 80 cached values per token and layer), yarn RoPE with mscale, a dense first
    # layer then MoE layers (shared expert, sigmoid group-limited routing over 2 groups),
    # and one MTP layer (speculative method mtp; HF's DeepseekV3 skips it).
    "tiny-deepseek-v3": {"arch": "deepseek_v3", "hidden_size": 256, "num_layers": 4,
                         "num_heads": 8, "num_kv_heads": 8, "intermediate_size": 512,
                         "max_position_embeddings": 4096, "config_overrides": {
                             "kv_lora_rank": 64, "q_lora_rank": 96, "qk_rope_head_dim": 16,
                             "qk_nope_head_dim": 32, "v_head_dim": 32, "n_routed_experts": 8,
                             "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
                             "moe_intermediate_size": 128, "n_shared_experts": 1,
                             "first_k_dense_replace": 1, "routed_scaling_factor": 2.5,
                             "num_nextn_predict_layers": 1,
                             "rope_parameters": {
                                 "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                 "original_max_position_embeddings": 1024, "beta_fast": 32,
                                 "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}}},
    # The same size with grouped-query attention (8 heads of 32, 4 KV heads: 256 cached
    # values per token and layer), the KV-bytes baseline beside tiny-deepseek-v3.
    "tiny-gqa-like-deepseek": {"arch": "llama", "hidden_size": 256, "num_layers": 4,
                               "num_heads": 8, "num_kv_heads": 4, "intermediate_size": 512,
                               "max_position_embeddings": 4096},
    # ~51M params; 12 layers (not 8) so per-layer KV streaming has realistic granularity.
    "bench-50m": {"arch": "llama", "vocab_size": 4096, "hidden_size": 512, "num_layers": 12,
                  "num_heads": 8, "num_kv_heads": 4, "intermediate_size": 2048},
}


# Presets whose weights are trained by scripts/train_tiny_model.py and shipped in ASSETS/<name>.
TRAINED_PRESETS = ("tiny-llama",)
ASSETS = Path(__file__).resolve().parent.parent / "assets"


def trained_model_path(name: str) -> Path:
    """The shipped checkpoint dir of a trained preset (package data; read it, never write it)."""
    path = ASSETS / name
    if not (path / "model.safetensors").is_file():
        raise FileNotFoundError(f"the {name} checkpoint is missing from {path}: reinstall "
                                f"pd-cluster or run scripts/train_tiny_model.py --out {path}")
    return path


def preset_names() -> list[str]:
    return list(PRESETS)
