"""Paged decode attention (flash-decoding / vLLM PagedAttention v2) over the paged KV cache.

One query token per sequence attends to its whole context, read from
``kv_cache[2, num_blocks, block_size, num_kv_heads, head_dim]`` through ``block_tables``.

Why split-K: with few sequences (B * num_kv_heads programs) a long context leaves most SMs
idle, so the context is cut into ``num_splits`` partitions processed in parallel; each writes an
unnormalised partial output plus its running max and sum-exp, and a second kernel combines them
(log-sum-exp rescaling). With one split the first kernel writes the final output directly.

One program handles all query heads of one KV head (GQA/MQA), so each K/V tile is loaded once
and used by the whole group through ``tl.dot``; the group is padded to 16 rows (masked) since
``tl.dot`` needs dims >= 16. Tokens are gathered per row through the block table, so the key
tile size is independent of the cache block size (8..128).
"""
from __future__ import annotations

import math

import torch

from kernels import interpreting, runs_triton, triton_available
from kernels.kv_quant import cache_parts

HAS_TRITON = triton_available()
_INTERPRETED = interpreting()

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _paged_decode_kernel(
        out_ptr, part_out_ptr, part_m_ptr, part_l_ptr,
        q_ptr, k_ptr, v_ptr, block_tables_ptr, seq_lens_ptr, sinks_ptr,
        scale, softcap, window,  # softcap/window/sinks only read when their flag is set
        num_splits, partition_size,  # partition_size is a multiple of TILE_N
        stride_qb, stride_qh, stride_ob, stride_oh,
        stride_kb, stride_ks, stride_kh, stride_kd,  # V is a view of the same cache: same strides
        stride_btb,
        ks_ptr, vs_ptr, stride_sb, stride_sh,  # FP8 blocks' K/V scales, read when SCALED
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, TILE_N: tl.constexpr,
        DIRECT: tl.constexpr, DOT_PREC: tl.constexpr,
        SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, SINKS: tl.constexpr,
        SCALED: tl.constexpr = False,
    ):
        # int64 program ids: every offset built from them is then 64-bit, so caches above 2^31
        # elements (e.g. 100k blocks * 16 * 8 * 128 * 2) address correctly.
        b = tl.program_id(0).to(tl.int64)
        kvh = tl.program_id(1).to(tl.int64)
        split = tl.program_id(2)
        num_q_heads = tl.num_programs(1) * GROUP

        seq_len = tl.load(seq_lens_ptr + b)
        start = split * partition_size
        end = tl.minimum(start + partition_size, seq_len)
        if WINDOW:  # the query (position seq_len - 1) sees the last `window` keys only
            start = tl.maximum(start, seq_len - window)

        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, TILE_N)
        g_mask = offs_g < GROUP
        d_mask = offs_d < HEAD_DIM  # head dims like 80/96 are padded to BLOCK_D and masked
        heads = kvh * GROUP + offs_g

        q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=g_mask[:, None] & d_mask[None, :], other=0.0)

        m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
        bt_row = block_tables_ptr + b * stride_btb
        head_off = kvh * stride_kh
        for t0 in range(start, end, TILE_N):
            tok = t0 + offs_n
            n_mask = tok < end
            blk = tl.load(bt_row + tok // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
            row_off = blk * stride_kb + (tok % BLOCK_SIZE).to(tl.int64) * stride_ks + head_off
            kv_off = row_off[:, None] + offs_d[None, :] * stride_kd
            kv_mask = n_mask[:, None] & d_mask[None, :]
            k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)
            if SCALED:  # FP8 block: converted and scaled per (block, head) in registers
                s_off = blk * stride_sb + kvh * stride_sh
                k_sc = tl.load(ks_ptr + s_off, mask=n_mask, other=0.0)
                k = (k.to(tl.float32) * k_sc[:, None]).to(q.dtype)
            s = _scores_log2(tl.dot(q, tl.trans(k), input_precision=DOT_PREC), scale, softcap,
                             SOFTCAP)
            s = tl.where(n_mask[None, :], s, float("-inf"))
            # Every tile holds >= 1 valid token (t0 < end), so m_new is finite.
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)
            if SCALED:
                v_sc = tl.load(vs_ptr + s_off, mask=n_mask, other=0.0)
                v = (v.to(tl.float32) * v_sc[:, None]).to(q.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
            m_i = m_new

        row_mask = g_mask[:, None] & d_mask[None, :]
        if DIRECT:
            if SINKS:  # the sink is one more softmax term with no value
                sink = tl.load(sinks_ptr + heads, mask=g_mask, other=0.0) * 1.4426950408889634
                l_i += tl.exp2(sink - tl.where(m_i == float("-inf"), sink, m_i))
            l_safe = tl.where(l_i > 0.0, l_i, 1.0)
            o = acc / l_safe[:, None]
            tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=row_mask)
        else:
            # Partials: [B, Hq, num_splits] (+ HEAD_DIM); an empty split stores m=-inf, l=0.
            idx = (b * num_q_heads + heads) * num_splits + split
            tl.store(part_out_ptr + idx[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=row_mask)
            tl.store(part_m_ptr + idx, m_i, mask=g_mask)
            tl.store(part_l_ptr + idx, l_i, mask=g_mask)

    @triton.jit
    def _scores_log2(s, scale, softcap, SOFTCAP: tl.constexpr):
        """Raw q.k -> scaled (and soft-capped: cap * tanh(s / cap)) logits in base 2."""
        if SOFTCAP:
            t = s * scale / softcap
            # tanh from exp (saturates to +-1 for large |t|): no tanh in the interpreter
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * t) + 1.0)) * 1.4426950408889634
        else:
            s = s * (scale * 1.4426950408889634)
        return s

    @triton.jit
    def _reduce_splits_kernel(
        out_ptr, part_out_ptr, part_m_ptr, part_l_ptr, sinks_ptr,
        num_splits, stride_ob, stride_oh,
        HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
        SINKS: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        num_q_heads = tl.num_programs(1)
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, BLOCK_D)
        s_mask = offs_s < num_splits
        d_mask = offs_d < HEAD_DIM
        idx = (b * num_q_heads + h) * num_splits + offs_s
        m = tl.load(part_m_ptr + idx, mask=s_mask, other=float("-inf"))
        l = tl.load(part_l_ptr + idx, mask=s_mask, other=0.0)
        m_max = tl.max(m, 0)
        # Rescale each split to the global max; empty splits (l == 0) weigh nothing.
        w = tl.where(l > 0.0, tl.exp2(m - m_max), 0.0)
        denom = tl.sum(w * l, 0)
        if SINKS:
            denom += tl.exp2(tl.load(sinks_ptr + h) * 1.4426950408889634 - m_max)
        denom = tl.where(denom > 0.0, denom, 1.0)
        parts = tl.load(part_out_ptr + idx[:, None] * HEAD_DIM + offs_d[None, :],
                        mask=s_mask[:, None] & d_mask[None, :], other=0.0)
        o = tl.sum(parts * w[:, None], 0) / denom
        tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d,
                 o.to(out_ptr.dtype.element_ty), mask=d_mask)


MAX_SPLITS = 128
MIN_PARTITION = 256  # tokens; shorter partitions cost more in the reduce than they save
_SM_COUNT: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # interpreter / CPU: parallelism is irrelevant, keep one split
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def choose_num_splits(batch: int, num_kv_heads: int, max_seq_len: int,
                      device: torch.device) -> int:
    """Enough splits to give ~4 programs per SM, but no partition shorter than MIN_PARTITION."""
    programs = max(1, batch * num_kv_heads)
    want = math.ceil(4 * _num_sms(device) / programs)
    by_len = math.ceil(max(max_seq_len, 1) / MIN_PARTITION)
    return max(1, min(want, by_len, MAX_SPLITS))


def paged_decode_attention(query: torch.Tensor, kv_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           num_splits: int | None = None, max_seq_len: int | None = None,
                           out: torch.Tensor | None = None, sliding_window: int | None = None,
                           softcap: float | None = None,
                           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """query [B, Hq, D] -> out [B, Hq, D]; block_tables int32 [B, max_blocks], seq_lens [B].

    ``max_seq_len`` (an upper bound of ``seq_lens``) avoids a device sync when given.
    ``num_splits`` forces the split-K factor (tests); by default it follows the context length.
    ``sliding_window``: attend to the last ``window`` keys only; ``softcap``: logits become
    cap * tanh(logits / cap); ``sinks``: fp32 [Hq] per-head sink logits in the denominator.
    """
    if not runs_triton(HAS_TRITON, _INTERPRETED, query, kv_cache):
        res = paged_decode_attention_ref(query, kv_cache, block_tables, seq_lens, scale,
                                         sliding_window, softcap, sinks)
        return res if out is None else out.copy_(res)
    bsz, num_q_heads, head_dim = query.shape
    k_cache, v_cache, scales = cache_parts(kv_cache, query.shape[-1])
    block_size, num_kv_heads, cache_head_dim = k_cache.shape[1:]
    if num_q_heads % num_kv_heads or cache_head_dim != head_dim:
        raise ValueError(f"query heads {num_q_heads} x {head_dim} do not fit kv_cache heads "
                         f"{num_kv_heads} x {cache_head_dim}")
    if block_size & (block_size - 1):
        raise ValueError(f"kv_cache block size must be a power of two, got {block_size}")
    if out is None:
        out = torch.empty_like(query)
    if bsz == 0:
        return out
    if query.stride(-1) != 1:
        query = query.contiguous()
    if out.stride(-1) != 1:
        raise ValueError("out: the last dimension must be contiguous")
    block_tables = block_tables.contiguous()
    seq_lens = seq_lens.to(torch.int32).contiguous()
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max().item())
    group = num_q_heads // num_kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))
    tile_n = 64 if block_d <= 128 else 32
    if num_splits is None:
        num_splits = choose_num_splits(bsz, num_kv_heads, max_seq_len, query.device)
    num_splits = max(1, min(int(num_splits), MAX_SPLITS))
    partition = triton.cdiv(max(triton.cdiv(max_seq_len, num_splits), 1), tile_n) * tile_n
    num_splits = max(1, triton.cdiv(max_seq_len, partition))  # drop splits that are all empty
    direct = num_splits == 1
    if direct:
        part_out = part_m = part_l = out  # unused placeholders
    else:
        f32 = dict(device=query.device, dtype=torch.float32)
        part_out = torch.empty(bsz, num_q_heads, num_splits, head_dim, **f32)
        part_m = torch.empty(bsz, num_q_heads, num_splits, **f32)
        part_l = torch.empty(bsz, num_q_heads, num_splits, **f32)
    sinks_arg = seq_lens if sinks is None else sinks.to(torch.float32).contiguous()
    ks, vs = scales if scales is not None else (seq_lens, seq_lens)  # unused placeholders
    _paged_decode_kernel[(bsz, num_kv_heads, num_splits)](
        out, part_out, part_m, part_l, query, k_cache, v_cache, block_tables, seq_lens,
        sinks_arg, scale, softcap or 1.0, sliding_window or 0, num_splits, partition,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3),
        block_tables.stride(0), ks, vs, ks.stride(0), ks.stride(-1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d, TILE_N=tile_n,
        DIRECT=direct, DOT_PREC="ieee" if query.dtype == torch.float32 else "tf32",
        SOFTCAP=softcap is not None, WINDOW=sliding_window is not None,
        SINKS=sinks is not None, SCALED=scales is not None, num_warps=4,
    )
    if not direct:
        _reduce_splits_kernel[(bsz, num_q_heads)](
            out, part_out, part_m, part_l, sinks_arg, num_splits, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_S=max(2, triton.next_power_of_2(num_splits)),
            BLOCK_D=block_d, SINKS=sinks is not None, num_warps=4,
        )
    return out


def attention_probs_ref(s: torch.Tensor, visible: torch.Tensor, softcap: float | None,
                        sinks: torch.Tensor | None) -> torch.Tensor:
    """Scaled scores [H, Lq, L] -> probabilities: soft-cap, mask, softmax with the per-head
    sink logit as one more (dropped) column. Shared by both references."""
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~visible, float("-inf"))
    if sinks is None:
        return s.softmax(-1)
    sink = sinks.float().view(-1, 1, 1).expand(*s.shape[:-1], 1)
    return torch.cat([s, sink], dim=-1).softmax(-1)[..., :-1]


def paged_decode_attention_ref(query: torch.Tensor, kv_cache: torch.Tensor,
                               block_tables: torch.Tensor, seq_lens: torch.Tensor,
                               scale: float, sliding_window: int | None = None,
                               softcap: float | None = None,
                               sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference: per sequence, gather its tokens through the block table (fp32 math)."""
    bsz, num_q_heads, head_dim = query.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_q_heads // num_kv_heads
    out = torch.zeros_like(query)
    for i, n in enumerate(seq_lens.tolist()):
        if n <= 0:
            continue
        pos = torch.arange(n, device=query.device)
        slots = block_tables[i].long()[pos // block_size] * block_size + pos % block_size
        k = kv_cache[0].flatten(0, 1)[slots].float()  # [n, Hkv, D]
        v = kv_cache[1].flatten(0, 1)[slots].float()
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        s = torch.einsum("hd,nhd->hn", query[i].float(), k)[:, None, :] * scale
        visible = pos >= n - sliding_window if sliding_window is not None else pos >= 0
        p = attention_probs_ref(s, visible[None, None, :], softcap, sinks)[:, 0]
        out[i] = torch.einsum("hn,nhd->hd", p, v).to(query.dtype)
    return out
