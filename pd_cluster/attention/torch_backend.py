"""Reference attention backend in plain torch: works on any device, reads K/V from the blocks."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.kv_quant import block_size_of, dequant_blocks, is_fp8, write_fp8
from pd_cluster.attention.base import AttentionBackend
from pd_cluster.attention.metadata import AttentionMetadata
from pd_cluster.attention.options import AttentionOptions


def write_kv_torch(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor,
                   static_scales: tuple[float, float] | None = None) -> None:
    if is_fp8(kv_cache.dtype):
        write_fp8(key, value, kv_cache, slot_mapping, static_scales)
        return
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    flat = kv_cache.view(2, -1, *kv_cache.shape[-2:])  # [2, num_blocks * block_size, H, D]
    flat[0].index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


def gather_kv(kv_cache: torch.Tensor, block_table: torch.Tensor, length: int, width: int,
              dtype: torch.dtype | None = None, first_block: int = 0
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's K and V (head dim ``width``) from block ``first_block`` to token
    ``length`` as dense [tokens, H, D] tensors (blocks before it are not read at all)."""
    block_size = block_size_of(kv_cache, width)
    blocks = block_table[first_block: -(-length // block_size)].long()
    n = length - first_block * block_size
    k = read_blocks(kv_cache, 0, blocks, dtype, width).flatten(0, 1)[:n]
    v = read_blocks(kv_cache, 1, blocks, dtype, width).flatten(0, 1)[:n]
    return k, v


def read_blocks(kv_cache: torch.Tensor, part: int, blocks: torch.Tensor,
                dtype: torch.dtype | None, width: int) -> torch.Tensor:
    """Blocks of one part [n, block_size, heads, width]: FP8 ones dequantised per block into
    ``dtype`` (the query's), others as stored."""
    if is_fp8(kv_cache.dtype):
        return dequant_blocks(kv_cache, part, blocks, dtype or torch.float32, width)
    return kv_cache[part].index_select(0, blocks)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
           opts: AttentionOptions) -> torch.Tensor:
    """q [..., Hq, Lq, D], k/v [..., Hkv, L, D], mask bool broadcastable to [..., Hq, Lq, L]
    (True = visible). Plain attention goes to SDPA; soft-capping and sinks, which SDPA cannot
    express, are computed explicitly in fp32 (HF's eager order: scale, cap, mask, softmax)."""
    if opts.logit_softcap is None and opts.sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=opts.scale,
                                              enable_gqa=True)
    group = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(group, dim=-3).float(), v.repeat_interleave(group, dim=-3).float()
    s = q.float() @ k.transpose(-1, -2) * opts.scale
    if opts.logit_softcap is not None:
        s = torch.tanh(s / opts.logit_softcap) * opts.logit_softcap
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    if opts.sinks is None:
        p = s.softmax(-1)
    else:  # the sink joins the softmax as one more logit per head and carries no value
        sink = opts.sinks.to(s.device).view(-1, 1, 1).expand(*s.shape[:-1], 1)
        p = torch.cat([s, sink], dim=-1).softmax(-1)[..., :-1]
    return (p @ v).to(q.dtype)


def window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Causal (and windowed) visibility [len(q_pos), len(k_pos)]: HF's window keeps keys
    q - window < k <= q."""
    mask = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        mask &= k_pos[None, :] > q_pos[:, None] - window
    return mask


def length_groups(lengths: list[int], min_fill: float = 0.6) -> list[list[int]]:
    """Indices grouped so that, padded to its longest member, each group is at least
    ``min_fill`` real keys: bounds the padding work of one batched call."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__, reverse=True)
    groups: list[list[int]] = []
    for i in order:
        if groups and lengths[i] >= min_fill * lengths[groups[-1][0]]:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def torch_decode_attention(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                           opts: AttentionOptions) -> torch.Tensor:
    """Decode requests (one query each) in a few batched calls of similar context length."""
    n = meta.num_decodes
    lengths = meta.seq_lens_cpu[:n]
    groups = length_groups(lengths)
    if len(groups) == 1:
        return _decode_group(query[:n], kv_cache, meta.block_tables[:n], meta.seq_lens[:n],
                             max(lengths), opts)
    out = torch.empty_like(query[:n])
    for group in groups:
        idx = torch.tensor(group, device=query.device)
        out[idx] = _decode_group(query[idx], kv_cache, meta.block_tables[idx], meta.seq_lens[idx],
                                 lengths[group[0]], opts)
    return out


def _decode_group(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor, max_len: int, opts: AttentionOptions,
                  value_dim: int | None = None) -> torch.Tensor:
    n, width = query.shape[0], query.shape[-1]
    block_size = block_size_of(kv_cache, width)
    # A window's blocks only: those before the earliest query's window are never read (a
    # decode engine may not even have received them, connectors/window_shipping.py).
    first = 0 if opts.sliding_window is None else max(
        0, int(seq_lens.min()) - opts.sliding_window) // block_size
    # index_select on the leading (block) dim copies whole blocks: several times faster on
    # CPU than advanced indexing, which gathers element-wise.
    flat = block_tables[:, first: -(-max_len // block_size)].long().flatten()
    k = read_blocks(kv_cache, 0, flat, query.dtype, width)
    v = read_blocks(kv_cache, 1, flat, query.dtype, width)
    k, v = k.view(n, -1, *k.shape[-2:]), v.view(n, -1, *v.shape[-2:])
    if value_dim is not None:
        v = v[..., :value_dim]
    k_pos = first * block_size + torch.arange(k.shape[1], device=query.device)[None, :]
    lens = seq_lens[:, None].to(query.device)
    mask = k_pos < lens  # [n, L]
    if opts.sliding_window is not None:  # the query sits at position len - 1
        mask &= k_pos >= lens - opts.sliding_window
    out = attend(query.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2),
                 mask[:, None, None, :], opts)
    return out.squeeze(2)


def torch_latent_decode(query: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
                        opts: AttentionOptions, value_dim: int) -> torch.Tensor:
    """Latent attention's absorbed decode over dense copies of each group's cached vectors:
    query [decodes, heads, cache_dim]; keys = the whole cached vector, values = its first
    ``value_dim`` entries (one "KV head" shared by all heads) -> [decodes, heads, value_dim]."""
    n = query.shape[0]  # the leading decodes
    lengths = meta.seq_lens_cpu[:n]
    out = query.new_empty(n, query.shape[1], value_dim)
    for group in length_groups(lengths):
        idx = torch.tensor(group, device=query.device)
        kv_cache = cache[0, None].expand(2, *cache.shape[1:])  # K and V: the same vectors
        o = _decode_group(query[idx], kv_cache, meta.block_tables[idx], meta.seq_lens[idx],
                          lengths[group[0]], opts, value_dim)
        out[idx] = o
    return out


def torch_prefill_attention(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                            opts: AttentionOptions, start_req: int, out: torch.Tensor) -> None:
    """Requests from ``start_req`` on, one at a time: causal over cached prefix + new tokens."""
    for i in range(start_req, meta.num_reqs):
        start, end = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
        seq_len, q_len = meta.seq_lens_cpu[i], end - start
        q = query[start:end].transpose(0, 1)  # [Hq, q_len, D]
        if q_len == seq_len and opts.plain:
            k, v = gather_kv(kv_cache, meta.block_tables[i], seq_len, q.shape[-1], query.dtype)
            o = F.scaled_dot_product_attention(q, k.transpose(0, 1), v.transpose(0, 1),
                                               is_causal=True, scale=opts.scale, enable_gqa=True)
        else:
            # Query i sits at position seq_len - q_len + i; keys before the first query's
            # window are never visible, so they are not read at all.
            first = 0 if opts.sliding_window is None else max(
                0, seq_len - q_len - opts.sliding_window + 1)
            bs = block_size_of(kv_cache, q.shape[-1])
            k, v = gather_kv(kv_cache, meta.block_tables[i], seq_len, q.shape[-1], query.dtype,
                             first // bs)
            skip = first - first // bs * bs
            q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
            k_pos = torch.arange(first, seq_len, device=query.device)
            o = attend(q, k[skip:].transpose(0, 1), v[skip:].transpose(0, 1),
                       window_mask(q_pos, k_pos, opts.sliding_window), opts)
        out[start:end] = o.transpose(0, 1)


def reference_latent(backend: AttentionBackend, query: torch.Tensor, cache: torch.Tensor,
                     meta: AttentionMetadata, opts: AttentionOptions, value_dim: int,
                     num_reqs: int) -> torch.Tensor:
    """``forward_latent`` for a backend without a latent kernel: the reference's absorbed
    decode (decodes only)."""
    if num_reqs > meta.num_decodes:
        raise ValueError(f"{backend.name} attention serves latent decodes only")
    return torch_latent_decode(query, cache, meta, opts, value_dim)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 meta: AttentionMetadata,
                 static_scales: tuple[float, float] | None = None) -> None:
        write_kv_torch(key, value, kv_cache, meta.slot_mapping, static_scales)

    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                opts: AttentionOptions) -> torch.Tensor:
        out = torch.empty_like(query)
        if meta.num_decodes:
            out[: meta.num_decodes] = torch_decode_attention(query, kv_cache, meta, opts)
        torch_prefill_attention(query, kv_cache, meta, opts, meta.num_decodes, out)
        return out

    def forward_latent(self, query: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
                       opts: AttentionOptions, value_dim: int, num_reqs: int) -> torch.Tensor:
        return reference_latent(self, query, cache, meta, opts, value_dim, num_reqs)
