"""Prefill (chunked) attention over a paged prefix.

Request ``r`` has query tokens ``query[qsl[r]:qsl[r+1]]``; they are the last ``q_len`` tokens of
its ``seq_len``-token context, whose K/V (the new tokens included) are already in the paged
cache. Each query token at position ``p`` attends causally to cache tokens ``0..p``.

One program handles a tile of BLOCK_Q query tokens times all query heads of one KV head
(rows = token x head, GQA packing), so each K/V tile is loaded once per group; no split-K here,
as prefill already has many query tiles to spread over the GPU.
"""
from __future__ import annotations

import torch

from kernels import interpreting, runs_triton, triton_available
from kernels.kv_quant import cache_parts
from kernels.paged_decode_attention import attention_probs_ref

HAS_TRITON = triton_available()
_INTERPRETED = interpreting()

if HAS_TRITON:
    import triton
    import triton.language as tl

    from kernels.paged_decode_attention import _scores_log2

    @triton.jit
    def _paged_prefill_kernel(
        out_ptr, q_ptr, k_ptr, v_ptr, block_tables_ptr, seq_lens_ptr, qsl_ptr, sinks_ptr,
        start_req, scale, softcap, window,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kb, stride_ks, stride_kh, stride_kd, stride_btb,
        ks_ptr, vs_ptr, stride_sb, stride_sh,  # FP8 blocks' K/V scales, read when SCALED
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_G: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_D: tl.constexpr, TILE_N: tl.constexpr, DOT_PREC: tl.constexpr,
        SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, SINKS: tl.constexpr,
        SCALED: tl.constexpr = False,
    ):
        # BLOCK_M = BLOCK_Q * BLOCK_G rows: row r is query token r // BLOCK_G, head r % BLOCK_G.
        req = (start_req + tl.program_id(0)).to(tl.int64)
        q_tile0 = tl.program_id(1) * BLOCK_Q
        kvh = tl.program_id(2).to(tl.int64)  # int64 so all derived offsets are 64-bit

        q_start = tl.load(qsl_ptr + req).to(tl.int64)
        q_len = tl.load(qsl_ptr + req + 1) - q_start
        seq_len = tl.load(seq_lens_ptr + req)
        ctx = seq_len - q_len  # cached prefix before this chunk

        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, TILE_N)
        tok = q_tile0 + offs_m // BLOCK_G  # query token within the chunk
        g = offs_m % BLOCK_G
        row_valid = (tok < q_len) & (g < GROUP)
        d_mask = offs_d < HEAD_DIM
        q_pos = ctx + tok
        heads = kvh * GROUP + g
        q_rows = (q_start + tok).to(tl.int64)
        q = tl.load(q_ptr + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh
                    + offs_d[None, :], mask=row_valid[:, None] & d_mask[None, :], other=0.0)

        # Keys needed by the last token of this tile (none if the tile lies past the chunk).
        kv_end = tl.minimum(seq_len, ctx + q_tile0 + BLOCK_Q)
        kv_end = tl.where(q_tile0 < q_len, kv_end, 0)
        kv_start = 0
        if WINDOW:  # keys before the first row's window are visible to no row of the tile
            kv_start = tl.maximum(ctx + q_tile0 - window + 1, 0)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        bt_row = block_tables_ptr + req * stride_btb
        for t0 in range(kv_start, kv_end, TILE_N):
            kpos = t0 + offs_n
            n_mask = kpos < kv_end
            blk = tl.load(bt_row + kpos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
            row_off = blk * stride_kb + (kpos % BLOCK_SIZE).to(tl.int64) * stride_ks \
                + kvh * stride_kh
            kv_off = row_off[:, None] + offs_d[None, :] * stride_kd
            kv_mask = n_mask[:, None] & d_mask[None, :]
            k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)
            if SCALED:  # FP8 block: converted and scaled per (block, head) in registers
                s_off = blk * stride_sb + kvh * stride_sh
                k_sc = tl.load(ks_ptr + s_off, mask=n_mask, other=0.0)
                k = (k.to(tl.float32) * k_sc[:, None]).to(q.dtype)
            s = _scores_log2(tl.dot(q, tl.trans(k), input_precision=DOT_PREC), scale, softcap,
                             SOFTCAP)
            visible = n_mask[None, :] & (kpos[None, :] <= q_pos[:, None])
            if WINDOW:
                visible = visible & (kpos[None, :] > q_pos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
            # A row may see no key of a tile (a window starts later, or a padded row): keep
            # its max at -inf but exponentiate against 0 so no inf - inf appears.
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_use)
            p = tl.exp2(s - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)
            if SCALED:
                v_sc = tl.load(vs_ptr + s_off, mask=n_mask, other=0.0)
                v = (v.to(tl.float32) * v_sc[:, None]).to(q.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
            m_i = m_new

        if SINKS:  # the sink is one more softmax term with no value
            sink = tl.load(sinks_ptr + heads, mask=row_valid, other=0.0) * 1.4426950408889634
            l_i += tl.exp2(sink - tl.where(m_i == float("-inf"), sink, m_i))
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        o = acc / l_safe[:, None]
        tl.store(out_ptr + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh
                 + offs_d[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=row_valid[:, None] & d_mask[None, :])


def paged_prefill_attention(query: torch.Tensor, kv_cache: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor,
                            query_start_loc: torch.Tensor, scale: float, max_query_len: int,
                            start_req: int = 0, num_reqs: int | None = None,
                            out: torch.Tensor | None = None, sliding_window: int | None = None,
                            softcap: float | None = None,
                            sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention for requests ``start_req .. start_req+num_reqs`` of a batch.

    query/out: [num_tokens, Hq, D] for the whole batch (rows of other requests are untouched);
    query_start_loc int32 [num_reqs_total + 1]; seq_lens / block_tables per request.
    ``max_query_len`` bounds those requests' chunk lengths (host int, avoids a sync).
    ``sliding_window`` / ``softcap`` / ``sinks``: as in paged_decode_attention.
    """
    if num_reqs is None:
        num_reqs = seq_lens.shape[0] - start_req
    if out is None:
        out = torch.zeros_like(query)
    if not runs_triton(HAS_TRITON, _INTERPRETED, query, kv_cache):
        return paged_prefill_attention_ref(query, kv_cache, block_tables, seq_lens,
                                           query_start_loc, scale, start_req, num_reqs, out,
                                           sliding_window, softcap, sinks)
    if num_reqs <= 0 or max_query_len <= 0:
        return out
    num_q_heads, head_dim = query.shape[1], query.shape[2]
    k_cache, v_cache, scales = cache_parts(kv_cache, query.shape[-1])
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if num_q_heads % num_kv_heads or k_cache.shape[3] != head_dim:
        raise ValueError(f"query heads {num_q_heads} x {head_dim} do not fit kv_cache heads "
                         f"{num_kv_heads} x {k_cache.shape[3]}")
    if block_size & (block_size - 1):
        raise ValueError(f"kv_cache block size must be a power of two, got {block_size}")
    if query.stride(-1) != 1:
        query = query.contiguous()
    if out.stride(-1) != 1:
        raise ValueError("out: the last dimension must be contiguous")
    group = num_q_heads // num_kv_heads
    block_g = triton.next_power_of_2(group)
    block_q = max(1, 64 // block_g)
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_tables = block_tables.contiguous()
    grid = (num_reqs, triton.cdiv(max_query_len, block_q), num_kv_heads)
    seq_lens = seq_lens.to(torch.int32).contiguous()
    sinks_arg = seq_lens if sinks is None else sinks.to(torch.float32).contiguous()
    ks, vs = scales if scales is not None else (seq_lens, seq_lens)  # unused placeholders
    _paged_prefill_kernel[grid](
        out, query, k_cache, v_cache, block_tables, seq_lens,
        query_start_loc.to(torch.int32).contiguous(), sinks_arg, start_req, scale,
        softcap or 1.0, sliding_window or 0,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3),
        block_tables.stride(0), ks, vs, ks.stride(0), ks.stride(-1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_G=block_g,
        BLOCK_Q=block_q, BLOCK_M=block_q * block_g, BLOCK_D=block_d, TILE_N=64 if block_d <= 128 else 32,
        DOT_PREC="ieee" if query.dtype == torch.float32 else "tf32", SOFTCAP=softcap is not None,
        WINDOW=sliding_window is not None, SINKS=sinks is not None,
        SCALED=scales is not None, num_warps=4,
        num_stages=2 if query.element_size() == 4 else 3,  # fp32 tiles: keep shared mem < 100KB
    )
    return out


def paged_prefill_attention_ref(query: torch.Tensor, kv_cache: torch.Tensor,
                                block_tables: torch.Tensor, seq_lens: torch.Tensor,
                                query_start_loc: torch.Tensor, scale: float,
                                start_req: int = 0, num_reqs: int | None = None,
                                out: torch.Tensor | None = None,
                                sliding_window: int | None = None, softcap: float | None = None,
                                sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference (fp32 math): per request, gather its context and mask causally."""
    if out is None:
        out = torch.zeros_like(query)
    lens = seq_lens.tolist()
    locs = query_start_loc.tolist()
    if num_reqs is None:
        num_reqs = len(lens) - start_req
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = query.shape[1] // num_kv_heads
    for r in range(start_req, start_req + num_reqs):
        q0, q1, n = locs[r], locs[r + 1], lens[r]
        if q1 <= q0:
            continue
        pos = torch.arange(n, device=query.device)
        slots = block_tables[r].long()[pos // block_size] * block_size + pos % block_size
        k = kv_cache[0].flatten(0, 1)[slots].float().repeat_interleave(group, dim=1)
        v = kv_cache[1].flatten(0, 1)[slots].float().repeat_interleave(group, dim=1)
        q_pos = torch.arange(n - (q1 - q0), n, device=query.device)
        s = torch.einsum("thd,nhd->htn", query[q0:q1].float(), k) * scale
        visible = pos[None, :] <= q_pos[:, None]
        if sliding_window is not None:
            visible &= pos[None, :] > q_pos[:, None] - sliding_window
        p = attention_probs_ref(s, visible[None], softcap, sinks)
        out[q0:q1] = torch.einsum("htn,nhd->thd", p, v).to(out.dtype)
    return out
