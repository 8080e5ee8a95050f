"""Prefill chunks over an FP8 KV cache attend over their own K/V at model precision.

A chunk's K/V are computed in this step, so quantising them and reading them back only adds
error (SGLang's extend attention and vLLM's prefill do the same: the cache is read for the
context before the chunk only). Each prefill request gets a temporary cache in the query's
dtype holding its context blocks dequantised from the FP8 cache and, at the chunk's positions,
the fresh K/V as written; the backend's own non-FP8 path then attends over it, so a chunk with
no context computes exactly what an auto-KV engine computes, and one after cached context (an
earlier chunk, a prefix hit) differs from auto only by that context's quantisation. Decode rows
still read the FP8 cache: their own token's K/V is the cache's from the next step on anyway.

The chunk's quantised K/V are still written (later chunks, decode steps and the P/D connector
read them). The temporary cache costs ``2 * seq_len * kv_heads * head_dim`` elements per
prefill request and layer, what the torch backend's gather of the context already costs.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kernels.kv_quant import block_size_of, dequant_blocks, is_fp8
from pd_cluster.attention.metadata import AttentionMetadata
from pd_cluster.attention.options import AttentionOptions

if TYPE_CHECKING:
    from pd_cluster.attention.base import AttentionBackend


def sub_metadata(meta: AttentionMetadata, reqs: range,
                 block_tables: torch.Tensor | None = None) -> AttentionMetadata:
    """The metadata of requests ``reqs`` alone (their tokens renumbered from 0); decodes stay
    decodes. ``block_tables``: theirs, if not the batch's rows."""
    loc = meta.query_start_loc_cpu
    base = loc[reqs.start]
    qsl = [x - base for x in loc[reqs.start:reqs.stop + 1]]
    lens = meta.seq_lens_cpu[reqs.start:reqs.stop]
    return AttentionMetadata(
        slot_mapping=meta.slot_mapping[base:loc[reqs.stop]],
        query_start_loc=torch.tensor(qsl, dtype=torch.int32,
                                     device=meta.query_start_loc.device),
        seq_lens=meta.seq_lens[reqs.start:reqs.stop],
        block_tables=(meta.block_tables[reqs.start:reqs.stop] if block_tables is None
                      else block_tables),
        num_decodes=max(0, min(meta.num_decodes, reqs.stop) - reqs.start),
        max_query_len=max(b - a for a, b in zip(qsl, qsl[1:])),
        max_seq_len=max(lens), block_size=meta.block_size,
        query_start_loc_cpu=qsl, seq_lens_cpu=lens)


def fresh_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, reqs: range, opts: AttentionOptions,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A cache [2, blocks, block_size, kv_heads, head_dim] in ``dtype`` for requests ``reqs``
    (prefill chunks) and their block tables: each request's context dequantised from the FP8
    ``kv_cache`` (from the first block its window can see), its chunk's ``key``/``value`` rows
    at their positions, zeros elsewhere (read by no query, and never NaN)."""
    width, heads = key.shape[-1], key.shape[-2]
    bs = block_size_of(kv_cache, width)
    loc, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    counts = [-(-lens[i] // bs) for i in reqs]
    cache = torch.zeros(2, sum(counts), bs, heads, width, dtype=dtype, device=key.device)
    tables = torch.zeros(len(reqs), max(counts), dtype=torch.int32, device=key.device)
    flat = cache.view(2, -1, heads, width)
    base = 0
    for j, i in enumerate(reqs):
        start, stop, seq_len = loc[i], loc[i + 1], lens[i]
        ctx = seq_len - (stop - start)
        tables[j, :counts[j]] = torch.arange(base, base + counts[j], dtype=torch.int32)
        if ctx:
            # The chunk's first query (position ctx) sees keys > ctx - window: blocks before
            # that are not read (a sliding group may have given them back).
            first = 0 if opts.sliding_window is None else max(
                0, ctx - opts.sliding_window + 1) // bs
            blocks = meta.block_tables[i, first:-(-ctx // bs)].long()
            for part in range(2):
                cache[part, base + first:base + first + len(blocks)] = dequant_blocks(
                    kv_cache, part, blocks, dtype, width)
        at = base * bs
        flat[0, at + ctx:at + seq_len] = key[start:stop].to(dtype)
        flat[1, at + ctx:at + seq_len] = value[start:stop].to(dtype)
        base += counts[j]
    return cache, tables


def forward_fresh(backend: "AttentionBackend", query: torch.Tensor, key: torch.Tensor,
                  value: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                  opts: AttentionOptions) -> torch.Tensor:
    """``backend.forward`` over ``kv_cache`` (``key``/``value``: this step's K/V, already
    written), except that with an FP8 cache the prefill chunks attend over their fresh K/V
    (module docstring)."""
    nd = meta.num_decodes
    if not is_fp8(kv_cache.dtype) or meta.num_reqs == nd:
        return backend.forward(query, kv_cache, meta, opts)
    loc = meta.query_start_loc_cpu
    n_dec, n_real = loc[nd], loc[-1]
    out = query.new_zeros(query.shape)  # padding rows past n_real: defined zeros
    if nd:
        out[:n_dec] = backend.forward(query[:n_dec], kv_cache, sub_metadata(meta, range(nd)),
                                      opts)
    reqs = range(nd, meta.num_reqs)
    cache, tables = fresh_cache(key, value, kv_cache, meta, reqs, opts, query.dtype)
    out[n_dec:n_real] = backend.forward(query[n_dec:n_real], cache,
                                        sub_metadata(meta, reqs, tables), opts)
    return out
