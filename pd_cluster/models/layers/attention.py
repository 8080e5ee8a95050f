"""Attention blocks, built by ``kind`` from a registry; ``standard`` is multi-head / grouped
/ multi-query attention with the per-layer options of ``AttentionSpec``.

The attention block is the only model code that sees the KV cache and the KV connector.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn

from pd_cluster.attention.options import AttentionOptions
from pd_cluster.engine.kv_spec import FullAttentionSpec, attention_spec
from pd_cluster.models.context import ForwardContext
from pd_cluster.models.layers.linear import QKVParallelLinear, RowParallelLinear
from pd_cluster.models.layers.norm import RMSNorm, ShardedRMSNorm
from pd_cluster.models.layers.paged_call import paged_call
from pd_cluster.models.layers.rotary import RotaryEmbedding
from pd_cluster.models.layers.tp import TPGroup
from pd_cluster.models.spec import ModelSpec

AttentionBuilder = Callable[[ModelSpec, int, TPGroup], nn.Module]
_ATTENTIONS: dict[str, AttentionBuilder] = {}


def register_attention(kind: str) -> Callable[[AttentionBuilder], AttentionBuilder]:
    def wrap(builder: AttentionBuilder) -> AttentionBuilder:
        _ATTENTIONS[kind] = builder
        return builder
    return wrap


def build_attention(model: ModelSpec, layer_idx: int, tp: TPGroup) -> nn.Module:
    kind = model.layers[layer_idx].attention.kind
    if kind not in _ATTENTIONS:
        raise ValueError(f"attention kind {kind!r} is not supported "
                         f"(registered: {sorted(_ATTENTIONS)})")
    return _ATTENTIONS[kind](model, layer_idx, tp)


def paged_layer(layer_idx: int, ctx: ForwardContext, write: Callable[[torch.Tensor], None],
                compute: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Write this step's KV into the layer's paged cache (``write(cache)``) and attend
    (``compute(cache)``); the connector loads (consumer) before and ships (producer) after,
    layer by layer, whatever the layer caches."""
    kv_cache = ctx.kv_caches[layer_idx]
    if ctx.connector is not None and ctx.connector.loads_layerwise:
        ctx.connector.wait_for_layer_load(layer_idx)
    write(kv_cache)
    out = compute(kv_cache)
    if ctx.connector is not None:
        # This layer's KV is final in the cache: hand it to the pipe while the next computes.
        ctx.connector.save_kv_layer(layer_idx, kv_cache, ctx.meta_for(layer_idx))
    return out


def run_paged_attention(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        opts: AttentionOptions, ctx: ForwardContext,
                        kv_scales: tuple[float, float] | None = None) -> torch.Tensor:
    """Standard attention through the step's backend (K and V in the cache; ``kv_scales``:
    the checkpoint's static K/V scales, used by an FP8 cache, whose prefill chunks attend
    over this fresh K/V rather than its quantised copy)."""
    meta = ctx.meta_for(layer_idx)  # its KV cache group's block tables
    return paged_layer(layer_idx, ctx,
                       lambda cache: ctx.backend.write_kv(k, v, cache, meta, kv_scales),
                       lambda cache: ctx.backend.forward_fresh(q, k, v, cache, meta, opts))


class Attention(nn.Module):
    def __init__(self, model: ModelSpec, layer_idx: int, tp: TPGroup = TPGroup()) -> None:
        super().__init__()
        a = model.layers[layer_idx].attention
        self.layer_idx, self.head_dim = layer_idx, a.head_dim
        self.qkv_proj = QKVParallelLinear(model.hidden_size, a.head_dim, a.num_heads,
                                          a.num_kv_heads, bias=a.qkv_bias, tp=tp)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(a.num_heads * a.head_dim, model.hidden_size,
                                        bias=a.o_bias, tp=tp)
        self.qk_norm = a.qk_norm
        eps = model.rms_norm_eps
        if a.qk_norm == "head":
            self.q_norm = RMSNorm(a.head_dim, eps, model.norm)
            self.k_norm = RMSNorm(a.head_dim, eps, model.norm)
        elif a.qk_norm == "proj":
            if self.qkv_proj.kv_replicas > 1:
                raise ValueError(f"q/k norm over the projection with tensor_parallel_size="
                                 f"{tp.size} > num_key_value_heads={a.num_kv_heads}")
            self.q_norm = ShardedRMSNorm(a.num_heads * a.head_dim, eps, tp, model.norm)
            self.k_norm = ShardedRMSNorm(a.num_kv_heads * a.head_dim, eps, tp, model.norm)
        elif a.qk_norm is not None:
            raise ValueError(f"qk_norm {a.qk_norm!r} is not supported (head, proj)")
        if a.sinks:
            self.sinks = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)
        else:
            self.sinks = None
        self.rope_key = a.rope.key
        self.scale, self.window, self.softcap = a.scale, a.sliding_window, a.logit_softcap
        self.total_kv_heads = a.num_kv_heads
        self.tp = tp
        # The checkpoint's static K/V cache scales (models/kv_scales.py), if it has them.
        self.kv_scales: tuple[float, float] | None = None

    def kv_cache_spec(self, dtype: torch.dtype) -> FullAttentionSpec:
        """This rank's KV heads in the cache's ``dtype`` (sliding layers keep the whole
        history too)."""
        return attention_spec(self.num_kv_heads, self.head_dim, dtype, self.window)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: Any = None) -> None:
        param.data.copy_(loaded.narrow(0, self.tp.rank * self.num_heads, self.num_heads))

    def options(self) -> AttentionOptions:
        sinks = None if self.sinks is None else self.sinks.float()
        return AttentionOptions(self.scale, self.window, self.softcap, sinks)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm == "proj":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.reshape(n, self.num_heads, self.head_dim)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = RotaryEmbedding.apply(ctx.rope[self.rope_key], q, k)
        out = paged_call(self, (q, k, v), (self.num_heads, self.head_dim), ctx)
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))

    def paged_forward(self, inputs: Sequence[torch.Tensor], ctx: ForwardContext) -> torch.Tensor:
        """Outside a compiled graph (paged_call.py): (q, k, v) -> the attention output."""
        q, k, v = inputs
        return run_paged_attention(self.layer_idx, q, k, v, self.options(), ctx, self.kv_scales)


register_attention("standard")(Attention)
