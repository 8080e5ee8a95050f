"""Triton attention backend: paged kernels from ``kernels/`` (the default on CUDA).

write_kv -> ``reshape_and_cache``; forward -> split-K paged decode kernel for the leading
decode requests, paged prefill kernel for the prefill chunks. Importing this module touches no
CUDA and does not import Triton (``kernels`` resolves its launchers lazily).
"""
from __future__ import annotations

import torch

from pd_cluster.attention.base import AttentionBackend
from pd_cluster.attention.metadata import AttentionMetadata
from pd_cluster.attention.options import AttentionOptions
from pd_cluster.attention.torch_backend import (reference_latent, torch_decode_attention,
                                                torch_prefill_attention)


class TritonAttentionBackend(AttentionBackend):
    """``num_splits`` forces the decode split-K factor (None: chosen from context length);
    ``prefill_kernel=False`` routes prefill chunks through torch instead."""

    name = "triton"

    def __init__(self, num_splits: int | None = None, prefill_kernel: bool = True) -> None:
        self.num_splits = num_splits
        self.prefill_kernel = prefill_kernel

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 meta: AttentionMetadata,
                 static_scales: tuple[float, float] | None = None) -> None:
        from kernels.reshape_and_cache import reshape_and_cache
        reshape_and_cache(key, value, kv_cache, meta.slot_mapping, static_scales)

    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                opts: AttentionOptions) -> torch.Tensor:
        from kernels.paged_decode_attention import paged_decode_attention
        from kernels.paged_prefill_attention import paged_prefill_attention

        out = torch.empty_like(query)
        nd = meta.num_decodes
        use_kernels = self._kernel_runs(query, kv_cache)
        variant = dict(sliding_window=opts.sliding_window, softcap=opts.logit_softcap,
                       sinks=opts.sinks)
        if nd and not use_kernels:  # CPU without the interpreter: the torch path
            out[:nd] = torch_decode_attention(query, kv_cache, meta, opts)
        elif nd:
            paged_decode_attention(query[:nd], kv_cache, meta.block_tables[:nd],
                                   meta.seq_lens[:nd], opts.scale, num_splits=self.num_splits,
                                   max_seq_len=max(meta.seq_lens_cpu[:nd]), out=out[:nd],
                                   **variant)
        if meta.num_reqs > nd:
            if self.prefill_kernel and use_kernels:
                locs = meta.query_start_loc_cpu
                max_q = max(locs[i + 1] - locs[i] for i in range(nd, meta.num_reqs))
                paged_prefill_attention(query, kv_cache, meta.block_tables, meta.seq_lens,
                                        meta.query_start_loc, opts.scale, max_q, start_req=nd,
                                        num_reqs=meta.num_reqs - nd, out=out, **variant)
            else:
                torch_prefill_attention(query, kv_cache, meta, opts, nd, out)
        n_real = meta.query_start_loc_cpu[-1]
        if query.shape[0] > n_real:  # padding tokens (e.g. graph padding): defined zeros
            out[n_real:].zero_()
        return out

    def forward_latent(self, query: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
                       opts: AttentionOptions, value_dim: int, num_reqs: int) -> torch.Tensor:
        return reference_latent(self, query, cache, meta, opts, value_dim, num_reqs)

    @staticmethod
    def _kernel_runs(query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        """Triton can run here (CUDA, or the interpreter); else the torch helpers are faster."""
        import kernels.paged_decode_attention as m
        from kernels import runs_triton
        return runs_triton(m.HAS_TRITON, m._INTERPRETED, query, kv_cache)
