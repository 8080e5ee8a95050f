"""Llama-family decoder (Llama, Qwen2, Mistral) over the paged KV cache.

Module names mirror Hugging Face's so checkpoints load without renaming. The attention layer
is the only model code that sees the KV cache and the connector (through ForwardContext).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pd_cluster.attention import AttentionBackend, AttentionMetadata


@dataclass
class ModelArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool


@dataclass
class ForwardContext:
    """Everything a forward step passes down to the attention layers."""
    attn_metadata: AttentionMetadata
    kv_caches: list[torch.Tensor]
    backend: AttentionBackend
    connector: Any = None  # worker-side KV connector, or None
    rope: tuple[torch.Tensor, torch.Tensor] | None = None  # this step's cos/sin, shared by layers


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 as HF does, so low-precision runs match it.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float, max_positions: int):
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tables for this step's positions, looked up once and used by every layer."""
        return (self.cos[positions].unsqueeze(1).to(dtype),
                self.sin[positions].unsqueeze(1).to(dtype))

    @staticmethod
    def apply(cos_sin: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor, k: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = cos_sin
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int, rotary: RotaryEmbedding):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = (
            args.num_heads, args.num_kv_heads, args.head_dim)
        self.scale = args.head_dim ** -0.5
        # q, k and v in one matmul (HF's q_proj/k_proj/v_proj are concatenated at load time):
        # one weight read and one kernel call instead of three.
        self.q_size = args.num_heads * args.head_dim
        self.kv_size = args.num_kv_heads * args.head_dim
        self.qkv_proj = nn.Linear(args.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=args.qkv_bias)
        self.o_proj = nn.Linear(args.num_heads * args.head_dim, args.hidden_size, bias=args.o_bias)
        self.rotary = rotary

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        q, k = RotaryEmbedding.apply(ctx.rope, q, k)
        kv_cache = ctx.kv_caches[self.layer_idx]
        if ctx.connector is not None and ctx.connector.loads_layerwise:
            ctx.connector.wait_for_layer_load(self.layer_idx)
        ctx.backend.write_kv(k, v, kv_cache, ctx.attn_metadata)
        out = ctx.backend.forward(q, kv_cache, ctx.attn_metadata, self.scale)
        if ctx.connector is not None:
            # This layer's KV is final in the cache: hand it to the pipe while the next computes.
            ctx.connector.save_kv_layer(self.layer_idx, kv_cache, ctx.attn_metadata)
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        # gate and up in one matmul (concatenated at load time, as for qkv).
        self.gate_up_proj = nn.Linear(args.hidden_size, 2 * args.intermediate_size,
                                      bias=args.mlp_bias)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=args.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int, rotary: RotaryEmbedding):
        super().__init__()
        self.self_attn = Attention(args, layer_idx, rotary)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        rotary = RotaryEmbedding(args.head_dim, args.rope_theta, args.max_position_embeddings)
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args, i, rotary) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        ctx.rope = self.layers[0].self_attn.rotary.cos_sin(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, ctx)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = LlamaModel(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        """Returns final hidden states [num_tokens, hidden]; logits only where needed."""
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
