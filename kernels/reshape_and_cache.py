"""Store a step's new K/V into the paged cache by slot mapping.

``key``/``value`` [T, Hkv, D] go to ``kv_cache[0/1]`` at flat slot
``block * block_size + offset``; slot -1 marks a padding token and is skipped.
"""
from __future__ import annotations

import torch

from kernels import interpreting, runs_triton, triton_available
from kernels.kv_quant import is_fp8, write_fp8

HAS_TRITON = triton_available()
_INTERPRETED = interpreting()

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _reshape_and_cache_kernel(
        key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
        num_kv_heads,
        stride_kt, stride_kh, stride_vt, stride_vh,
        stride_cb, stride_cs, stride_ch, stride_cd,
        HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        # Padding tokens (slot < 0) are masked out entirely rather than returning early.
        # (offs_h * 0 + slot): a vector compare, since a scalar-bool mask trips the interpreter.
        h_ok = (offs_h < num_kv_heads) & ((offs_h * 0 + slot) >= 0)
        mask = h_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
        # int64: slot * stride can exceed 2^31 in a large cache.
        dst = ((slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
               + offs_h[:, None] * stride_ch + offs_d[None, :] * stride_cd)
        k = tl.load(key_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :],
                    mask=mask)
        v = tl.load(value_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :],
                    mask=mask)
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor,
                      static_scales: tuple[float, float] | None = None) -> None:
    """key/value [T, Hkv, D] -> kv_cache[2, num_blocks, block_size, Hkv, D] (in place). An
    FP8 cache (kv_quant.py) takes the quantising write, in torch on every device: its
    per-block scales grow as a block fills, re-quantising the block, which this kernel's
    one-token-per-program layout does not do."""
    if is_fp8(kv_cache.dtype):
        write_fp8(key, value, kv_cache, slot_mapping, static_scales)
        return
    if not runs_triton(HAS_TRITON, _INTERPRETED, key, kv_cache):
        reshape_and_cache_ref(key, value, kv_cache, slot_mapping)
        return
    num_tokens, num_kv_heads, head_dim = key.shape
    block_size = kv_cache.shape[2]
    if num_tokens == 0:
        return
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    slot_mapping = slot_mapping[:num_tokens].contiguous()
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, num_kv_heads,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3),
        HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim), num_warps=4,
    )


def reshape_and_cache_ref(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                          slot_mapping: torch.Tensor) -> None:
    """Torch reference (and the CPU path): index_put_ by (block, offset), valid for any strides."""
    slots = slot_mapping[:key.shape[0]].long()
    keep = slots >= 0
    if not bool(keep.all()):
        slots, key, value = slots[keep], key[keep], value[keep]
    block_size = kv_cache.shape[2]
    blk, off = slots // block_size, slots % block_size
    kv_cache[0][blk, off] = key.to(kv_cache.dtype)
    kv_cache[1][blk, off] = value.to(kv_cache.dtype)
