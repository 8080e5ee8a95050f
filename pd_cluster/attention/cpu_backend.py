"""CPU attention backend: the C++ paged kernel (kernels/cpu/paged_attention.cpp), the default
on CPU.

The kernel serves decode tokens and prefill chunks, reading K/V in place from the paged
blocks. On a CPU with AMX, long bf16/fp16 chunks go to ATen's flash kernel over gathered K/V
instead (cpu_prefill.py), whose GEMMs run on the AMX tiles: 1.6-2.7x the paged kernel there.
The torch backend, which gathers every request's context into dense tensors, stays as the
reference this one is tested against.
"""
from __future__ import annotations

import torch

from kernels.kv_quant import is_fp8, split
from pd_cluster.attention import cpu_prefill
from pd_cluster.attention.base import AttentionBackend
from pd_cluster.attention.metadata import AttentionMetadata
from pd_cluster.attention.options import AttentionOptions
from pd_cluster.attention.torch_backend import write_kv_torch


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    meta: AttentionMetadata, opts: AttentionOptions, reqs: range | None = None,
                    out: torch.Tensor | None = None,
                    scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """query [T, Hq, D]; key_cache [blocks, block_size, Hkv, D]; value_cache
    [blocks, block_size, Hkv, Dv] (may be a view of the same memory, as latent attention's
    values are) -> out [T, Hq, Dv]. Computes the tokens of requests ``reqs`` (default: all);
    other rows of ``out`` are left as they are. ``scales``: an FP8 cache's K and V scales
    [blocks, Hkv] (kernels/kv_quant.py), applied per block as it is converted."""
    if out is None:
        out = query.new_empty(*query.shape[:2], value_cache.shape[-1])
    r = range(meta.num_reqs) if reqs is None else reqs
    if len(r):
        torch.ops.pd_cluster_cpu.paged_attention(
            out, query, key_cache, value_cache, meta.block_tables[r.start:r.stop],
            meta.seq_lens[r.start:r.stop], meta.query_start_loc[r.start:r.stop + 1],
            opts.scale, opts.sliding_window or 0, opts.logit_softcap or 0.0, opts.sinks,
            *(scales or (None, None)))
    return out


def _split_forward(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                   meta: AttentionMetadata, opts: AttentionOptions) -> torch.Tensor:
    """Long prefill chunks through the flash kernel, runs of the other requests (decodes
    first, short chunks) through the paged kernel, each into its rows of one output."""
    out = query.new_empty(*query.shape[:2], value_cache.shape[-1])
    run_start = 0  # the first request of the current run of short ones
    for i in range(meta.num_decodes, meta.num_reqs):
        if cpu_prefill.is_long(meta, i):
            if run_start < i:
                paged_attention(query, key_cache, value_cache, meta, opts, range(run_start, i), out)
            cpu_prefill.prefill_one(query, key_cache, value_cache, meta, opts, i, out)
            run_start = i + 1
    if run_start < meta.num_reqs:
        paged_attention(query, key_cache, value_cache, meta, opts,
                        range(run_start, meta.num_reqs), out)
    return out


class CpuAttentionBackend(AttentionBackend):
    name = "cpu"
    latent_prefill_in_place = True

    def __init__(self) -> None:
        from kernels.cpu_build import load_cpu_kernels, load_error
        if not load_cpu_kernels():
            raise RuntimeError(f"attention_backend 'cpu': the C++ kernel is unavailable "
                               f"({load_error()}); use 'torch' or 'auto'")

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 meta: AttentionMetadata,
                 static_scales: tuple[float, float] | None = None) -> None:
        if (kv_cache.dim() == 5 and not is_fp8(kv_cache.dtype)
                and key.dtype == value.dtype == kv_cache.dtype
                and key.shape[1:] == kv_cache.shape[3:]):
            torch.ops.pd_cluster_cpu.write_kv(kv_cache, key, value, meta.slot_mapping)
        else:  # FP8 (quantised per block), another dtype or layout: the torch path
            write_kv_torch(key, value, kv_cache, meta.slot_mapping, static_scales)

    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                opts: AttentionOptions) -> torch.Tensor:
        if is_fp8(kv_cache.dtype):  # the kernel reads FP8 and applies each block's scales
            data, scales = split(kv_cache, query.shape[-1])
            out = paged_attention(query, data[0], data[1], meta, opts,
                                  scales=(scales[0], scales[1]))
        elif (cpu_prefill.flash_pays(query.dtype)
              and cpu_prefill.applies(query, kv_cache[0], kv_cache[1], opts)):
            out = _split_forward(query, kv_cache[0], kv_cache[1], meta, opts)
        else:
            out = paged_attention(query, kv_cache[0], kv_cache[1], meta, opts)
        n_real = meta.query_start_loc_cpu[-1]
        if query.shape[0] > n_real:  # padding tokens (e.g. a compiled step's): defined zeros
            out[n_real:].zero_()
        return out

    def forward_latent(self, query: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
                       opts: AttentionOptions, value_dim: int, num_reqs: int) -> torch.Tensor:
        return paged_attention(query, cache[0], cache[0][..., :value_dim], meta, opts,
                               range(num_reqs))
