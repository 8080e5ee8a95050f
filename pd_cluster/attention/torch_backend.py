"""Reference attention backend in plain torch: works on any device, reads K/V from the blocks."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pd_cluster.attention.base import AttentionBackend, register_backend
from pd_cluster.attention.metadata import AttentionMetadata


def write_kv_torch(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    flat = kv_cache.view(2, -1, *kv_cache.shape[-2:])  # [2, num_blocks * block_size, H, D]
    flat[0].index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


def gather_kv(kv_cache: torch.Tensor, block_table: torch.Tensor, length: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's first ``length`` K and V as dense [length, H, D] tensors."""
    block_size = kv_cache.shape[2]
    blocks = block_table[: -(-length // block_size)].long()
    k = kv_cache[0].index_select(0, blocks).flatten(0, 1)[:length]
    v = kv_cache[1].index_select(0, blocks).flatten(0, 1)[:length]
    return k, v


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
                           scale: float) -> torch.Tensor:
    """Decode requests (one query each) in a few batched calls of similar context length."""
    n = meta.num_decodes
    lengths = meta.seq_lens_cpu[:n]
    groups = length_groups(lengths)
    if len(groups) == 1:
        return _decode_group(query[:n], kv_cache, meta.block_tables[:n], meta.seq_lens[:n],
                             max(lengths), scale)
    out = torch.empty_like(query[:n])
    for group in groups:
        idx = torch.tensor(group, device=query.device)
        out[idx] = _decode_group(query[idx], kv_cache, meta.block_tables[idx], meta.seq_lens[idx],
                                 lengths[group[0]], scale)
    return out


def _decode_group(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor, max_len: int, scale: float) -> torch.Tensor:
    n, block_size = query.shape[0], kv_cache.shape[2]
    # index_select on the leading (block) dim copies whole blocks: several times faster on
    # CPU than advanced indexing, which gathers element-wise.
    flat = block_tables[:, : -(-max_len // block_size)].long().flatten()
    k = kv_cache[0].index_select(0, flat).view(n, -1, *kv_cache.shape[-2:])  # [n, L, Hkv, D]
    v = kv_cache[1].index_select(0, flat).view(n, -1, *kv_cache.shape[-2:])
    mask = (torch.arange(k.shape[1], device=query.device)[None, :]
            < seq_lens[:, None].to(query.device))  # [n, L]
    out = F.scaled_dot_product_attention(
        query.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True)
    return out.squeeze(2)


def torch_prefill_attention(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                            scale: float, start_req: int, out: torch.Tensor) -> None:
    """Requests from ``start_req`` on, one at a time: causal over cached prefix + new tokens."""
    for i in range(start_req, meta.num_reqs):
        start, end = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
        seq_len, q_len = meta.seq_lens_cpu[i], end - start
        k, v = gather_kv(kv_cache, meta.block_tables[i], seq_len)
        q = query[start:end].transpose(0, 1)  # [Hq, q_len, D]
        if q_len == seq_len:
            o = F.scaled_dot_product_attention(q, k.transpose(0, 1), v.transpose(0, 1),
                                               is_causal=True, scale=scale, enable_gqa=True)
        else:
            # Query i sits at position seq_len - q_len + i and sees keys up to it.
            rows = torch.arange(seq_len - q_len, seq_len, device=query.device)[:, None]
            mask = torch.arange(seq_len, device=query.device)[None, :] <= rows
            o = F.scaled_dot_product_attention(q, k.transpose(0, 1), v.transpose(0, 1),
                                               attn_mask=mask, scale=scale, enable_gqa=True)
        out[start:end] = o.transpose(0, 1)


@register_backend("torch")
class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 meta: AttentionMetadata) -> None:
        write_kv_torch(key, value, kv_cache, meta.slot_mapping)

    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        out = torch.empty_like(query)
        if meta.num_decodes:
            out[: meta.num_decodes] = torch_decode_attention(query, kv_cache, meta, scale)
        torch_prefill_attention(query, kv_cache, meta, scale, meta.num_decodes, out)
        return out
