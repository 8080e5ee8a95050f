"""CPU attention backend: the C++ paged kernel (kernels/cpu/paged_attention.cpp), the default
on CPU.

Decode tokens, and prefill chunks that continue a cached prefix, attend in one kernel call per
contiguous run of requests, reading K/V in place from the paged blocks. A prompt prefilled
from its start with plain attention goes to SDPA's flash kernel instead (blocked GEMMs; its
K/V are read once, a copy that is small beside the quadratic work). The torch backend, which
gathers every request's context into dense tensors, stays as the reference this one is tested
against.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pd_cluster.attention.base import AttentionBackend, register_backend
from pd_cluster.attention.metadata import AttentionMetadata
from pd_cluster.attention.options import AttentionOptions
from pd_cluster.attention.torch_backend import gather_kv, write_kv_torch


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    meta: AttentionMetadata, opts: AttentionOptions, reqs: range | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """query [T, Hq, D]; key_cache [blocks, block_size, Hkv, D]; value_cache
    [blocks, block_size, Hkv, Dv] (may be a view of the same memory, as latent attention's
    values are) -> out [T, Hq, Dv]. Computes the tokens of requests ``reqs`` (default: all);
    other rows of ``out`` are left as they are."""
    if out is None:
        out = query.new_empty(*query.shape[:2], value_cache.shape[-1])
    r = range(meta.num_reqs) if reqs is None else reqs
    if len(r):
        torch.ops.pd_cluster_cpu.paged_attention(
            out, query, key_cache, value_cache, meta.block_tables[r.start:r.stop],
            meta.seq_lens[r.start:r.stop], meta.query_start_loc[r.start:r.stop + 1],
            opts.scale, opts.sliding_window or 0, opts.logit_softcap or 0.0, opts.sinks)
    return out


def fresh_plain_prefills(meta: AttentionMetadata, opts: AttentionOptions) -> list[int]:
    """Requests whose whole context is new this step, under plain attention."""
    if not opts.plain:
        return []
    starts, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    return [i for i in range(meta.num_decodes, meta.num_reqs)
            if starts[i + 1] - starts[i] == lens[i] > 1]


@register_backend("cpu")
class CpuAttentionBackend(AttentionBackend):
    name = "cpu"

    def __init__(self) -> None:
        from kernels.cpu_build import load_cpu_kernels, load_error
        if not load_cpu_kernels():
            raise RuntimeError(f"attention_backend 'cpu': the C++ kernel is unavailable "
                               f"({load_error()}); use 'torch' or 'auto'")

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 meta: AttentionMetadata) -> None:
        write_kv_torch(key, value, kv_cache, meta.slot_mapping)

    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                opts: AttentionOptions) -> torch.Tensor:
        out = torch.empty_like(query)
        flash = fresh_plain_prefills(meta, opts)
        first = 0
        for i in flash + [meta.num_reqs]:  # the kernel takes the runs between them
            paged_attention(query, kv_cache[0], kv_cache[1], meta, opts, range(first, i), out)
            first = i + 1
        for i in flash:
            start, end = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
            k, v = gather_kv(kv_cache, meta.block_tables[i], end - start)
            out[start:end] = F.scaled_dot_product_attention(
                query[start:end].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                is_causal=True, scale=opts.scale, enable_gqa=True).transpose(0, 1)
        n_real = meta.query_start_loc_cpu[-1]
        if query.shape[0] > n_real:  # padding tokens (e.g. a compiled step's): defined zeros
            out[n_real:].zero_()
        return out

    latent_prefill_in_place = True

    def forward_latent(self, query: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
                       opts: AttentionOptions, value_dim: int, num_reqs: int) -> torch.Tensor:
        return paged_attention(query, cache[0], cache[0][..., :value_dim], meta, opts,
                               range(num_reqs))
