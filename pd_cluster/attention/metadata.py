"""What one forward step tells the attention layers about the batch.

KV cache layout, per layer (pd_cluster/engine/kv_spec.py): standard attention's
``kv_cache[2, num_blocks, block_size, num_kv_heads, head_dim]`` (index 0 = K, 1 = V); latent
attention's ``[1, num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]``; an FP8
cache packs each head's tokens and scale (kernels/kv_quant.py ``split`` views it as the
first). Token ``p`` of a request lives in slot
``block_table[p // block_size] * block_size + p % block_size``.

The batch is ordered decodes first: the first ``num_decodes`` requests have exactly one query
token each, so the first ``num_decodes`` tokens are decode tokens. The rest are prefill chunks.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # int64 [num_tokens]; -1 = padding, not written
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1]; request i's tokens are [loc[i], loc[i+1])
    seq_lens: torch.Tensor  # int32 [num_reqs]; context length after this step (computed + new)
    block_tables: torch.Tensor  # int32 [num_reqs, max_blocks]; padded with 0
    num_decodes: int
    max_query_len: int
    max_seq_len: int
    block_size: int
    # Host copies, so backends can loop over requests without device syncs.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)
