"""Grouped MoE expert matmuls in Triton (CUDA), beside their torch reference
(``fused_experts_ref``; the model's own torch path, ``moe_experts.grouped_experts``, is a
faster grouping of the same computation, and the tests hold all three equal).

The (token, slot) pairs are sorted by expert and each expert's run is padded to a multiple of
``BLOCK_M`` (``align_by_expert``, on the device, no host sync), so every M-tile of the sorted
list belongs to one expert; a program computes one [BLOCK_M, BLOCK_N] tile of
``A[rows] @ W[expert]^T (+ bias[expert])``. Two launches make the experts: gate/up from the
token rows, the activation in torch (it is the family's, e.g. gpt-oss's clamped SwiGLU),
then down from the pair rows. The output rows are pairs in token order (pair = token *
top_k + slot), so weighting and summing over the top_k slots is a reshape in torch,
deterministic (no atomics) and rounded as the torch path rounds.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from kernels import interpreting, runs_triton, triton_available

HAS_TRITON = triton_available()
_INTERPRETED = interpreting()
BLOCK_M = 16

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _grouped_matmul_kernel(
        a_ptr, w_ptr, bias_ptr, c_ptr, pair_ptr, block_expert_ptr,
        num_pairs, N, K, top_k,
        stride_am, stride_we, stride_wn, stride_be, stride_cm,
        A_BY_TOKEN: tl.constexpr, HAS_BIAS: tl.constexpr,
        DOT_PREC: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        pairs = tl.load(pair_ptr + offs_m).to(tl.int64)
        # Padding rows (pair == num_pairs) and tiles past the last expert's (expert -1) are
        # masked out (a vector compare: scalar-bool masks trip the interpreter).
        row_ok = (pairs < num_pairs) & ((pairs * 0 + expert) >= 0)
        if A_BY_TOKEN:  # gate/up reads the token's hidden state; down reads the pair's row
            a_rows = pairs // top_k
        else:
            a_rows = pairs
        n_ok = offs_n < N
        safe_e = tl.maximum(expert, 0)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = (k0 + offs_k) < K
            a = tl.load(a_ptr + a_rows[:, None] * stride_am + (k0 + offs_k)[None, :],
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptr + safe_e * stride_we + offs_n[None, :] * stride_wn
                        + (k0 + offs_k)[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc += tl.dot(a, w, input_precision=DOT_PREC)
        out = acc.to(c_ptr.dtype.element_ty)
        if HAS_BIAS:  # added to the rounded product, as torch's matmul-then-add rounds
            bias = tl.load(bias_ptr + safe_e * stride_be + offs_n, mask=n_ok, other=0.0)
            out = (out.to(tl.float32) + bias.to(tl.float32)[None, :]).to(c_ptr.dtype.element_ty)
        tl.store(c_ptr + pairs[:, None] * stride_cm + offs_n[None, :], out,
                 mask=row_ok[:, None] & n_ok[None, :])


def align_by_expert(ids: torch.Tensor, num_experts: int,
                    block_m: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, K] -> (pairs [P]: flat pair indices sorted by expert, each expert's run padded
    to a multiple of ``block_m`` with T*K; block_expert [P / block_m]: each tile's expert, -1
    past the last). Sized for the worst case so it needs no host sync."""
    flat = ids.reshape(-1)
    num_pairs, dev = flat.numel(), flat.device
    order = torch.argsort(flat, stable=True)
    # scatter_add, not bincount: bincount syncs with the host to size its output.
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(
        0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_start = torch.cumsum(padded, 0) - padded  # where each expert's run starts
    start = torch.cumsum(counts, 0) - counts
    sorted_e = flat[order]
    rank = torch.arange(num_pairs, device=dev) - start[sorted_e]
    cap = num_pairs + num_experts * (block_m - 1)
    cap = (cap + block_m - 1) // block_m * block_m
    pairs = torch.full((cap,), num_pairs, dtype=torch.int64, device=dev)
    pairs[pad_start[sorted_e] + rank] = order
    tile_start = torch.arange(0, cap, block_m, device=dev)
    ends = torch.cumsum(padded, 0)
    block_expert = torch.searchsorted(ends, tile_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1)
    return pairs, block_expert.to(torch.int32)


def _grouped_matmul(a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
                    pairs: torch.Tensor,
                    block_expert: torch.Tensor, num_pairs: int, top_k: int,
                    a_by_token: bool, out_dtype: torch.dtype) -> torch.Tensor:
    n, k = w.shape[1], w.shape[2]
    c = torch.empty(num_pairs, n, dtype=out_dtype, device=a.device)
    a, w = a.contiguous(), w.contiguous()
    block_n = 64 if n >= 64 else 32 if n >= 32 else 16
    block_k = 32 if k >= 32 else 16
    grid = (block_expert.numel(), triton.cdiv(n, block_n))
    _grouped_matmul_kernel[grid](
        a, w, bias if bias is not None else w, c,
        pairs, block_expert, num_pairs, n, k, top_k,
        a.stride(0), w.stride(0), w.stride(1), bias.stride(0) if bias is not None else 0,
        c.stride(0),
        A_BY_TOKEN=a_by_token, HAS_BIAS=bias is not None,
        DOT_PREC="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k)
    return c


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  weights: torch.Tensor, ids: torch.Tensor,
                  act: Callable[[torch.Tensor], torch.Tensor],
                  b13: torch.Tensor | None = None, b2: torch.Tensor | None = None) -> torch.Tensor:
    """``grouped_experts``'s contract (x [T, H], w13 [E, 2I, H], w2 [E, H, I], weights and
    ids [T, K]) on the Triton kernel; the torch path where Triton cannot run."""
    if not runs_triton(HAS_TRITON, _INTERPRETED, x, w13):
        return fused_experts_ref(x, w13, w2, weights, ids, act, b13, b2)
    num_tokens, top_k = ids.shape
    if num_tokens == 0:
        return torch.zeros_like(x)
    num_pairs = num_tokens * top_k
    pairs, block_expert = align_by_expert(ids, w13.shape[0])
    h = _grouped_matmul(x, w13, b13, pairs, block_expert, num_pairs, top_k, True, x.dtype)
    y = _grouped_matmul(act(h), w2, b2, pairs, block_expert, num_pairs, top_k, False, x.dtype)
    # The routing weights and the top-k sum as grouped_experts (transformers) rounds them.
    weighted = y * weights.reshape(-1, 1)
    return weighted.view(num_tokens, top_k, -1).sum(dim=1).to(x.dtype)


def fused_experts_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                      weights: torch.Tensor, ids: torch.Tensor,
                      act: Callable[[torch.Tensor], torch.Tensor],
                      b13: torch.Tensor | None = None,
                      b2: torch.Tensor | None = None) -> torch.Tensor:
    """``fused_experts`` in plain torch: every (token, slot) pair through its expert, weighted
    in the weights' dtype and summed over the slots, rounded as transformers' experts round."""
    num_tokens, top_k = ids.shape
    flat = ids.reshape(-1)
    rows = x.repeat_interleave(top_k, dim=0)  # pair = token * top_k + slot
    y = torch.zeros(flat.numel(), w2.shape[1], dtype=x.dtype, device=x.device)
    for e in flat.unique().tolist():
        mine = flat == e
        h = F.linear(rows[mine], w13[e])
        if b13 is not None:
            h = h + b13[e]
        out = F.linear(act(h), w2[e])
        y[mine] = out if b2 is None else out + b2[e]
    weighted = y * weights.reshape(-1, 1)
    return weighted.view(num_tokens, top_k, -1).sum(dim=1).to(x.dtype)
