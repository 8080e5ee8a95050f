"""Multi-head latent attention (DeepSeek-V2/V3), attention kind "latent", over the paged cache.

Per token the cache holds one vector: the normed latent (kv_lora_rank) then the roped key
(qk_rope_head_dim), the same for every head and every tensor-parallel rank. Heads split over
ranks (q_b_proj / kv_b_proj column-parallel by head, o_proj row-parallel); the latent
projections are replicated, so each rank writes the same cache.

Two ways to attend, equal in exact arithmetic:
- decompress: kv_b_proj turns the context's latents into per-head keys (nope part) and
  values, and attention runs as HF's does (the rope key broadcast to every head);
- absorb: the query's nope part goes through W_UK into latent space and the output through
  W_UV, so a step reads only the cached latents (keys = the whole cached vector, values = its
  latent part: one "KV head" shared by all query heads).
Decode tokens absorb. Prefill chunks absorb too where the backend reads the latents in place
(the CPU kernel: the whole batch in one call, no context copied out), else they decompress.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pd_cluster.attention.metadata import AttentionMetadata
from pd_cluster.attention.options import AttentionOptions
from pd_cluster.attention.base import AttentionBackend
from pd_cluster.attention.torch_backend import attend, window_mask
from pd_cluster.engine.kv_spec import LatentAttentionSpec
from pd_cluster.models.context import ForwardContext
from pd_cluster.models.layers.attention import paged_layer, register_attention
from pd_cluster.models.layers.linear import (ColumnParallelLinear, ReplicatedLinear,
                                             RowParallelLinear)
from pd_cluster.models.layers.norm import RMSNorm
from pd_cluster.models.layers.paged_call import paged_call
from pd_cluster.models.layers.tp import TPGroup
from pd_cluster.models.spec import ModelSpec


def rope_latent(cos_sin: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
                interleave: bool) -> torch.Tensor:
    """Rotate x [tokens, heads, rope_dim] as HF does: interleaved pairs (x0, x1), (x2, x3)...
    written back as [evens' rotation | odds' rotation], or the usual rotate-half."""
    cos, sin = cos_sin  # [tokens, 1, rope_dim] = cat(freqs, freqs)
    if interleave:
        half = cos.shape[-1] // 2
        cos, sin = cos[..., :half], sin[..., :half]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def write_latent(entry: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """entry [tokens, latent_dim] into cache [1, blocks, block_size, 1, latent_dim]."""
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        entry, slot_mapping = entry[valid], slot_mapping[valid]
    cache.view(-1, cache.shape[-1]).index_copy_(0, slot_mapping, entry.to(cache.dtype))


def gather_latent(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """One request's first ``length`` cached vectors [length, latent_dim]."""
    blocks = block_table[: -(-length // cache.shape[2])].long()
    return cache[0].index_select(0, blocks).flatten(0, 2)[:length]


class LatentAttention(nn.Module):
    def __init__(self, model: ModelSpec, layer_idx: int, tp: TPGroup = TPGroup()) -> None:
        super().__init__()
        a = model.layers[layer_idx].attention
        m = a.latent
        if m is None:
            raise ValueError("attention kind 'latent' needs AttentionSpec.latent")
        self.layer_idx, self.m, self.tp = layer_idx, m, tp
        _, self.num_heads = tp.split(a.num_heads, "num_attention_heads")
        h, eps = model.hidden_size, model.rms_norm_eps
        if m.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(h, a.num_heads * m.qk_head_dim, tp=tp)
        else:
            self.q_a_proj = ReplicatedLinear(h, m.q_lora_rank, a.qkv_bias, tp)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, eps, model.norm)
            self.q_b_proj = ColumnParallelLinear(m.q_lora_rank, a.num_heads * m.qk_head_dim,
                                                 tp=tp)
        self.kv_a_proj_with_mqa = ReplicatedLinear(h, m.cache_dim, a.qkv_bias, tp)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, eps, model.norm)
        self.kv_b_proj = ColumnParallelLinear(
            m.kv_lora_rank, a.num_heads * (m.qk_nope_head_dim + m.v_head_dim), tp=tp)
        self.kv_b_proj.keep_layout = True  # read as per-head W_UK / W_UV (_kv_b), not called
        self.o_proj = RowParallelLinear(a.num_heads * m.v_head_dim, h, bias=a.o_bias, tp=tp)
        self.rope_key, self.scale = a.rope.key, a.scale
        # What the engine reads (KVLayout): one cached "head" of the whole vector.
        self.num_kv_heads, self.head_dim, self.total_kv_heads = 1, m.cache_dim, 1

    def kv_cache_spec(self, dtype: torch.dtype) -> LatentAttentionSpec:
        return LatentAttentionSpec(self.m.cache_dim, dtype)

    def _kv_b(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's W_UK [heads, nope, latent] and W_UV [heads, v, latent]."""
        m = self.m
        w = self.kv_b_proj.weight.view(self.num_heads, m.qk_nope_head_dim + m.v_head_dim,
                                       m.kv_lora_rank)
        return w[:, :m.qk_nope_head_dim], w[:, m.qk_nope_head_dim:]

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        m, n = self.m, x.shape[0]
        q = (self.q_proj(x) if m.q_lora_rank is None
             else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))))
        q_nope, q_rope = q.view(n, self.num_heads, m.qk_head_dim).split(
            [m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([m.kv_lora_rank, m.qk_rope_head_dim],
                                                          dim=-1)
        cos_sin = ctx.rope[self.rope_key]
        q_rope = rope_latent(cos_sin, q_rope, m.rope_interleave)
        k_rope = rope_latent(cos_sin, k_rope.unsqueeze(1), m.rope_interleave).squeeze(1)
        entry = torch.cat([self.kv_a_layernorm(latent), k_rope], dim=-1)
        out = paged_call(self, (q_nope, q_rope, entry), (self.num_heads, m.v_head_dim), ctx)
        return self.o_proj(out.reshape(n, self.num_heads * m.v_head_dim))

    def paged_forward(self, inputs: Sequence[torch.Tensor], ctx: ForwardContext) -> torch.Tensor:
        """Outside a compiled graph (paged_call.py): (q_nope, q_rope, cache entry) -> the
        attention output [tokens, heads, v_head_dim]."""
        q_nope, q_rope, entry = inputs
        meta = ctx.meta_for(self.layer_idx)
        return paged_layer(self.layer_idx, ctx,
                           lambda cache: write_latent(entry, cache, meta.slot_mapping),
                           lambda cache: self._attend(q_nope, q_rope, cache, meta,
                                                      ctx.backend))

    def _attend(self, q_nope: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor,
                meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        out = q_nope.new_empty(q_nope.shape[0], self.num_heads, self.m.v_head_dim)
        # Decodes (and, where the backend reads latents in place, every request) absorbed;
        # the rest decompressed one request at a time.
        d = meta.num_reqs if backend.latent_prefill_in_place else meta.num_decodes
        if d:
            t = meta.query_start_loc_cpu[d]
            out[:t] = self.attend_absorbed(q_nope[:t], q_rope[:t], cache, meta, backend, d)
        for i in range(d, meta.num_reqs):
            start, end = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
            ctx_kv = gather_latent(cache, meta.block_tables[i], meta.seq_lens_cpu[i])
            out[start:end] = self.prefill_decompressed(q_nope[start:end], q_rope[start:end],
                                                       ctx_kv)
        return out

    def prefill_decompressed(self, q_nope: torch.Tensor, q_rope: torch.Tensor,
                             ctx_kv: torch.Tensor) -> torch.Tensor:
        """Queries [q_len, heads, *] at the last q_len positions of a context whose cached
        vectors are ``ctx_kv`` [seq_len, latent_dim]; causal. -> [q_len, heads, v]."""
        m = self.m
        seq_len, q_len = ctx_kv.shape[0], q_nope.shape[0]
        latent, k_rope = ctx_kv.split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        kv = F.linear(latent, self.kv_b_proj.weight).view(
            seq_len, self.num_heads, m.qk_nope_head_dim + m.v_head_dim)
        k_nope, v = kv.split([m.qk_nope_head_dim, m.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_rope[:, None].expand(-1, self.num_heads, -1)], dim=-1)
        q = torch.cat([q_nope, q_rope], dim=-1).transpose(0, 1)  # [heads, q_len, qk]
        k, v = k.transpose(0, 1), v.transpose(0, 1)
        if q_len == seq_len:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        else:
            pos = torch.arange(seq_len, device=q.device)
            o = attend(q, k, v, window_mask(pos[seq_len - q_len:], pos, None), self._opts())
        return o.transpose(0, 1)

    def attend_absorbed(self, q_nope: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor,
                        meta: AttentionMetadata, backend: AttentionBackend,
                        num_reqs: int | None = None) -> torch.Tensor:
        """The tokens of the batch's first ``num_reqs`` requests (default: its decodes) with
        W_UK folded into the query and W_UV into the output, so only the cached vectors are
        read (by the backend, in place where it can). -> [tokens, heads, v]."""
        w_uk, w_uv = self._kv_b()
        q_lat = torch.einsum("nhd,hdl->nhl", q_nope, w_uk)
        q = torch.cat([q_lat, q_rope], dim=-1)  # [n, heads, latent_dim]
        n = meta.num_decodes if num_reqs is None else num_reqs
        o_lat = backend.forward_latent(q, cache, meta, self._opts(), self.m.kv_lora_rank, n)
        return torch.einsum("nhl,hvl->nhv", o_lat, w_uv)

    def _opts(self) -> AttentionOptions:
        return AttentionOptions(self.scale, None, None, None)


register_attention("latent")(LatentAttention)
