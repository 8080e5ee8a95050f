"""Gather a request's blocks of one layer into a contiguous buffer, and scatter one back.

Buffer layout: ``[parts, n, block_size, heads, width]`` (K then V; latent attention's one
part), i.e. exactly the cache layout restricted to the listed blocks, so the KV connector can send it as one message
and the receiver can scatter it into its own (different) block ids.

A cache block (block_size * Hkv * D elements) is contiguous in memory for a contiguous cache,
so the kernels copy flat chunks of it; non-contiguous caches take the torch path.
"""
from __future__ import annotations

from typing import Sequence, Union

import torch

from kernels import interpreting, runs_triton, triton_available
from kernels.kv_quant import as_bytes

HAS_TRITON = triton_available()
_INTERPRETED = interpreting()
BlockIds = Union[torch.Tensor, Sequence[int]]
_CHUNK = 4096  # elements per program

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _block_copy_kernel(
        src_ptr, dst_ptr, ids_ptr, block_elems,
        src_stride_kv, src_stride_blk, dst_stride_kv, dst_stride_blk,
        GATHER: tl.constexpr, CHUNK: tl.constexpr,
    ):
        i = tl.program_id(0).to(tl.int64)  # index into the block id list / buffer
        kv = tl.program_id(1).to(tl.int64)
        chunk = tl.program_id(2).to(tl.int64)
        # int64 block id before multiplying by the block stride: a cache of > 2^31 elements
        # is common (tens of GB per layer stack), and an int32 product would wrap.
        blk = tl.load(ids_ptr + i).to(tl.int64)
        offs = chunk * CHUNK + tl.arange(0, CHUNK)
        mask = offs < block_elems
        if GATHER:  # cache block ids[i] -> buffer slot i
            src = src_ptr + kv * src_stride_kv + blk * src_stride_blk + offs
            dst = dst_ptr + kv * dst_stride_kv + i * dst_stride_blk + offs
        else:  # buffer slot i -> cache block ids[i]
            src = src_ptr + kv * src_stride_kv + i * src_stride_blk + offs
            dst = dst_ptr + kv * dst_stride_kv + blk * dst_stride_blk + offs
        x = tl.load(src, mask=mask)
        tl.store(dst, x.to(dst_ptr.dtype.element_ty), mask=mask)


def _as_ids(block_ids: BlockIds, device: torch.device) -> torch.Tensor:
    if isinstance(block_ids, torch.Tensor):
        return block_ids.to(device=device, dtype=torch.int64).contiguous()
    return torch.tensor(list(block_ids), dtype=torch.int64, device=device)


def _blocks_contiguous(t: torch.Tensor) -> bool:
    """Each [block_size, Hkv, D] block is one dense run of memory."""
    _, _, bs, h, d = t.shape
    return t.stride(4) == 1 and t.stride(3) == d and t.stride(2) == h * d


def _launch(src: torch.Tensor, dst: torch.Tensor, ids: torch.Tensor, gather: bool) -> None:
    block_elems = src.shape[2] * src.shape[3] * src.shape[4]
    grid = (ids.numel(), src.shape[0], triton.cdiv(block_elems, _CHUNK))
    src, dst = as_bytes(src), as_bytes(dst)  # FP8 blocks move as bytes
    _block_copy_kernel[grid](
        src, dst, ids, block_elems,
        src.stride(0), src.stride(1), dst.stride(0), dst.stride(1),
        GATHER=gather, CHUNK=_CHUNK, num_warps=4,
    )


def gather_kv_blocks(kv_cache: torch.Tensor, block_ids: BlockIds,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """kv_cache [P, N, bs, H, D], n block ids -> buffer [P, n, bs, H, D] (new or ``out``)."""
    ids = _as_ids(block_ids, kv_cache.device)
    if out is None:
        out = torch.empty((kv_cache.shape[0], ids.numel()) + tuple(kv_cache.shape[2:]),
                          dtype=kv_cache.dtype, device=kv_cache.device)
    if ids.numel() == 0:
        return out
    if (runs_triton(HAS_TRITON, _INTERPRETED, kv_cache, out)
            and _blocks_contiguous(kv_cache) and _blocks_contiguous(out)):
        _launch(kv_cache, out, ids, gather=True)
        return out
    return gather_kv_blocks_torch(kv_cache, ids, out)


def scatter_kv_blocks(buffer: torch.Tensor, kv_cache: torch.Tensor,
                      block_ids: BlockIds) -> None:
    """buffer [P, n, bs, H, D] -> kv_cache blocks ``block_ids`` (in place)."""
    ids = _as_ids(block_ids, kv_cache.device)
    if buffer.shape[1] != ids.numel() or buffer.shape[2:] != kv_cache.shape[2:]:
        raise ValueError(f"buffer {tuple(buffer.shape)} does not hold {ids.numel()} blocks of "
                         f"kv_cache {tuple(kv_cache.shape)}")
    if ids.numel() == 0:
        return
    if buffer.device != kv_cache.device:
        buffer = buffer.to(kv_cache.device, non_blocking=True)
    if (runs_triton(HAS_TRITON, _INTERPRETED, kv_cache, buffer)
            and _blocks_contiguous(kv_cache) and _blocks_contiguous(buffer)):
        _launch(buffer, kv_cache, ids, gather=False)
        return
    scatter_kv_blocks_torch(buffer, kv_cache, ids)


def gather_kv_blocks_torch(kv_cache: torch.Tensor, block_ids: BlockIds,
                           out: torch.Tensor) -> torch.Tensor:
    """Fast torch path (any device, never Triton): K and V separately along their leading
    block dim, so whole blocks are memcpy'd (~4x faster on CPU than index_select on dim 1)."""
    ids = _as_ids(block_ids, kv_cache.device)
    src, dst = as_bytes(kv_cache), as_bytes(out)  # FP8: copied as bytes
    for kv in range(src.shape[0]):
        torch.index_select(src[kv], 0, ids, out=dst[kv])
    return out


def scatter_kv_blocks_torch(buffer: torch.Tensor, kv_cache: torch.Tensor,
                            block_ids: BlockIds) -> None:
    ids = _as_ids(block_ids, kv_cache.device)
    buffer = buffer.to(kv_cache.device, kv_cache.dtype)
    kv_cache, buffer = as_bytes(kv_cache), as_bytes(buffer)  # FP8: copied as bytes
    for kv in range(kv_cache.shape[0]):
        kv_cache[kv].index_copy_(0, ids, buffer[kv])
