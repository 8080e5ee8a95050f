"""A model family as data: what the one decoder (decoder.py) is built from.

A family reader (families/*.py) turns an HF config into a ``ModelSpec``; nothing else about a
family lives in code. Attention and MLP blocks are looked up by ``kind`` in registries
(layers/attention.py, layers/mlp.py), so a new block (MoE, latent attention) is a registered
builder plus the options it reads from ``extra``, not an edit of the decoder.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pd_cluster.models.layers.rotary import RopeSpec


@dataclass(frozen=True)
class LatentSpec:
    """Multi-head latent attention's sizes (DeepSeek-V2/V3): queries through a LoRA of
    ``q_lora_rank`` (None: one q_proj), keys and values from one ``kv_lora_rank`` latent per
    token plus a shared ``qk_rope_head_dim`` rope key; ``rope_interleave``: the rope dims are
    rotated in interleaved pairs (HF's ``apply_rotary_pos_emb_interleave``)."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_dim(self) -> int:
        """Values cached per token: the normed latent, then the roped key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class AttentionSpec:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope: RopeSpec
    scale: float
    qkv_bias: bool = False
    o_bias: bool = False
    sliding_window: int | None = None  # HF's window (see pd_cluster.attention.options)
    logit_softcap: float | None = None
    sinks: bool = False  # a learned per-head sink logit (``self_attn.sinks``)
    qk_norm: str | None = None  # None | "head" (per head, Qwen3/Gemma 3) | "proj" (OLMo 2)
    kind: str = "standard"  # the attention builder (layers/attention.py registry)
    latent: LatentSpec | None = None  # kind "latent" (layers/mla.py); head_dim: q/k's
    extra: dict[str, Any] = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class MLPSpec:
    intermediate_size: int
    activation: str = "silu"
    bias: bool = False
    kind: str = "gated"  # the MLP builder (layers/mlp.py registry)
    extra: dict[str, Any] = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class NormPlacement:
    """Checkpoint names of a layer's norms, by where they apply (None: absent). ``*_in``
    normalise a sublayer's input, ``*_out`` its output before the residual add."""

    attn_in: str | None
    attn_out: str | None
    mlp_in: str | None
    mlp_out: str | None


PRE_NORM = NormPlacement("input_layernorm", None, "post_attention_layernorm", None)  # Llama
SANDWICH_NORM = NormPlacement("input_layernorm", "post_attention_layernorm",
                              "pre_feedforward_layernorm", "post_feedforward_layernorm")  # Gemma
POST_NORM = NormPlacement(None, "post_attention_layernorm", None,
                          "post_feedforward_layernorm")  # OLMo 2


@dataclass(frozen=True)
class LayerSpec:
    attention: AttentionSpec
    mlp: MLPSpec


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    vocab_size: int
    hidden_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    layers: tuple[LayerSpec, ...]
    norms: NormPlacement = PRE_NORM
    norm: str = "llama"  # RMSNorm kind: llama | scaled | gemma (layers/norm.py)
    embed_scale: bool = False  # embeddings times sqrt(hidden_size), in the activation dtype
    tie_word_embeddings: bool = False
    final_logit_softcap: float | None = None
    # Checkpoint tensor-name prefixes the model does not use (DeepSeek-V3's multi-token
    # prediction layers after the last decoder layer), skipped on load as HF skips them.
    skipped_weights: tuple[str, ...] = ()

    @property
    def num_layers(self) -> int:
        return len(self.layers)
