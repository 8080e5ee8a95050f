"""Long prefill chunks on CPU through ATen's flash attention, over K/V gathered from the blocks,
on CPUs with AMX.

In bf16/fp16 ATen's CPU flash kernel runs its GEMMs through oneDNN's brgemm, on AMX tiles
where the CPU has them: there, at one thread, bench-50m's heads, it is 1.6x the paged C++
kernel on a 512-token prompt and 2.7x on a 2048-token one (scripts/bench_attention.py --part
prefill). Without AMX (AVX-512 alone, with or without AVX512-BF16) the paged kernel, which
reads the blocks in place and shares a prompt's tiles among the threads, is the faster one in
every dtype, and fp32 has no AMX path to gain from; so only bf16/fp16 chunks on an AMX CPU
come here (``flash_pays``). Decode tokens and short chunks stay on the paged kernel.

A chunk after cached context (an earlier chunk of the prompt, or a prefix-cache hit) attends
to that context without a mask and to itself causally: two calls whose softmaxes are merged by
their log-sum-exp (exact: the same sums, split in two). Gathering the context copies
``2 * tokens * kv_heads * head_dim`` elements per layer, small against the attention itself.
"""
from __future__ import annotations

import torch

from pd_cluster import host_facts
from pd_cluster.attention.metadata import AttentionMetadata
from pd_cluster.attention.options import AttentionOptions

# Shorter chunks stay on the paged kernel: below this the gather and the two calls cost more
# than they save (measured at 1 thread, bench-50m's heads: the crossover is 32-64 tokens).
MIN_QUERY_TOKENS = 64
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def applies(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
            opts: AttentionOptions) -> bool:
    """Whether this layer's long chunks may go through the flash kernel: plain softmax
    attention (no window, soft-cap or sinks) in a float dtype, the cache in
    the query's dtype (an FP8 cache stays on the paged kernel, which converts it per block)."""
    return (query.dtype in _DTYPES and key_cache.dtype == value_cache.dtype == query.dtype
            and not opts.sliding_window and not opts.logit_softcap
            and opts.sinks is None and key_cache.shape[-1] == value_cache.shape[-1]
            and query.shape[-1] == key_cache.shape[-1])


def flash_pays(dtype: torch.dtype) -> bool:
    """Whether long chunks of ``dtype`` run faster through the flash kernel on this CPU: half
    precision on a CPU with AMX tiles (module docstring)."""
    return dtype in (torch.bfloat16, torch.float16) and "amx_tile" in host_facts.cpu_flags()


def is_long(meta: AttentionMetadata, i: int) -> bool:
    loc = meta.query_start_loc_cpu
    return loc[i + 1] - loc[i] >= MIN_QUERY_TOKENS


def _gather(cache: torch.Tensor, blocks: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Tokens [start, stop) of one request from the paged cache -> [1, heads, tokens, dim]."""
    bs = cache.shape[1]
    first, last = start // bs, (stop + bs - 1) // bs
    dense = cache[blocks[first:last]].flatten(0, 1)  # [(last-first)*bs, heads, dim]
    return dense[start - first * bs:stop - first * bs].transpose(0, 1).unsqueeze(0)


def prefill_one(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                meta: AttentionMetadata, opts: AttentionOptions, i: int,
                out: torch.Tensor) -> None:
    """Request ``i``'s chunk (its K/V already written to the blocks) into its rows of ``out``."""
    start, stop = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
    n, seq_len = stop - start, meta.seq_lens_cpu[i]
    ctx_len = seq_len - n
    blocks = meta.block_tables[i]
    q = query[start:stop].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
    k_new = _gather(key_cache, blocks, ctx_len, seq_len)
    v_new = _gather(value_cache, blocks, ctx_len, seq_len)
    o_new, lse_new = _flash(q, k_new, v_new, is_causal=True, scale=opts.scale)
    if ctx_len == 0:
        out[start:stop] = o_new[0].transpose(0, 1)
        return
    k_ctx = _gather(key_cache, blocks, 0, ctx_len)
    v_ctx = _gather(value_cache, blocks, 0, ctx_len)
    o_ctx, lse_ctx = _flash(q, k_ctx, v_ctx, is_causal=False, scale=opts.scale)
    # softmax over ctx ∪ new = the two partial softmaxes weighted by their shares of the sum
    top = torch.maximum(lse_ctx, lse_new)
    w_ctx, w_new = (lse_ctx - top).exp(), (lse_new - top).exp()
    total = w_ctx + w_new
    merged = (o_ctx.float() * (w_ctx / total).unsqueeze(-1)
              + o_new.float() * (w_new / total).unsqueeze(-1))
    out[start:stop] = merged[0].transpose(0, 1).to(out.dtype)
