"""The one decoder every dense family is built from (its differences are in ``ModelSpec``).

Module names mirror Hugging Face's (``model.layers.N.self_attn...``) so checkpoints load by
name; q/k/v and gate/up are fused per rank (see layers/linear.py for how they load).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pd_cluster.models.context import ForwardContext
from pd_cluster.models.layers.attention import build_attention
from pd_cluster.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pd_cluster.models.layers.linear import attach_weight_loaders
from pd_cluster.models.layers.mlp import build_mlp
from pd_cluster.models.layers.norm import RMSNorm
from pd_cluster.models.layers.rotary import RotaryEmbedding
from pd_cluster.models.layers.tp import TPGroup
from pd_cluster.models.spec import ModelSpec


@dataclass(frozen=True)
class KVLayout:
    """What the engine reads about the model's KV (``model.args``); the cache itself is sized
    and allocated from ``CausalLM.kv_cache_specs()`` (one spec per layer, kv_spec.py).
    ``num_kv_heads`` x ``head_dim``: layer 0's cached heads on this rank and their width
    (latent attention: 1 x the latent). ``total_kv_heads``: the model's, over all ranks (the
    connector's routing between TP sizes; latent: 1, every rank holds it).
    ``sliding_windows`` per layer is informational: window layers keep the full history.
    ``prefix_cacheable``: a block's KV depends only on the tokens up to it (False for
    longrope, whose factors depend on the whole sequence's length: no prefix sharing)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    sliding_windows: tuple[int | None, ...]
    prefix_cacheable: bool = True
    total_kv_heads: int = 0


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int, tp: TPGroup = TPGroup()) -> None:
        super().__init__()
        self.self_attn = build_attention(spec, layer_idx, tp)
        self.mlp = build_mlp(spec, layer_idx, tp)
        p = spec.norms
        for name in (p.attn_in, p.attn_out, p.mlp_in, p.mlp_out):
            if name is not None:
                self.add_module(name, RMSNorm(spec.hidden_size, spec.rms_norm_eps, spec.norm))
        self._placement = p

    def _norm(self, name: str | None, x: torch.Tensor) -> torch.Tensor:
        return x if name is None else getattr(self, name)(x)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        p = self._placement
        h = self._norm(p.attn_out, self.self_attn(self._norm(p.attn_in, x), ctx))
        x = x + h
        return x + self._norm(p.mlp_out, self.mlp(self._norm(p.mlp_in, x)))


class DecoderModel(nn.Module):
    def __init__(self, spec: ModelSpec, tp: TPGroup = TPGroup()) -> None:
        super().__init__()
        self.spec = spec
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(spec, i, tp) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, spec.norm)
        # One rotary per distinct RoPE (Gemma 3: local and global); cos/sin computed once a step.
        self.rotary = {layer.attention.rope.key: RotaryEmbedding(layer.attention.rope)
                       for layer in spec.layers}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.spec.embed_scale:  # HF rounds the scale to the activation dtype first
            x = x * torch.tensor(self.spec.hidden_size ** 0.5, dtype=x.dtype)
        ctx.rope = {key: rot.cos_sin(positions, x.dtype, ctx.rope_lens)
                    for key, rot in self.rotary.items()}
        for layer in self.layers:
            x = layer(x, ctx)
        return self.norm(x)


class CausalLM(nn.Module):
    def __init__(self, spec: ModelSpec, tp: TPGroup = TPGroup()) -> None:
        super().__init__()
        self.spec, self.tp = spec, tp
        self.model = DecoderModel(spec, tp)
        self.lm_head = ParallelLMHead(spec.vocab_size, spec.hidden_size, tp)
        self.tie_weights()
        attach_weight_loaders(self)
        attn = self.model.layers[0].self_attn
        self.args = KVLayout(spec.num_layers, attn.num_kv_heads, attn.head_dim, spec.vocab_size,
                             tuple(layer.attention.sliding_window for layer in spec.layers),
                             all(layer.attention.rope.rope_type != "longrope"
                                 for layer in spec.layers), attn.total_kv_heads)

    def kv_cache_specs(self, dtype: torch.dtype) -> list[Any]:
        """What each layer caches on this rank (its attention's ``kv_cache_spec``) in a cache
        of ``dtype``."""
        return [layer.self_attn.kv_cache_spec(dtype) for layer in self.model.layers]

    def materialize(self, dtype: torch.dtype, device: torch.device) -> "CausalLM":
        """A meta-built model's parameters as uninitialised ``dtype`` tensors on ``device``."""
        self.to(dtype).to_empty(device=device)
        self.tie_weights()  # to_empty made one tensor per owner of the shared weight
        attach_weight_loaders(self)
        return self

    def tie_weights(self) -> None:
        """Tied embeddings share one tensor (again after the loader moved the parameters)."""
        if self.spec.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        """Returns final hidden states [num_tokens, hidden]; logits only where needed."""
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        cap = self.spec.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap
