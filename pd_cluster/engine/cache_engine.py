"""Per-layer paged KV tensors and the decision of how many blocks fit."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def block_bytes(self) -> int:
        """Bytes one block occupies across all layers, K and V."""
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem


def determine_num_blocks(spec: KVCacheSpec, device: torch.device, num_kv_blocks: int | None,
                         cpu_budget_bytes: int, gpu_memory_utilization: float,
                         peak_activation_bytes: int = 0) -> int:
    if num_kv_blocks is not None:
        num, why = num_kv_blocks, "num_kv_blocks"
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used_by_us = torch.cuda.memory_allocated(device)
        budget = int(total * gpu_memory_utilization) - used_by_us - peak_activation_bytes
        budget = min(budget, free - peak_activation_bytes)
        num, why = budget // spec.block_bytes, (
            f"gpu_memory_utilization={gpu_memory_utilization} of {total / 2**30:.1f} GiB, "
            f"weights {used_by_us / 2**30:.2f} GiB, peak activations "
            f"{peak_activation_bytes / 2**30:.2f} GiB")
    else:
        num, why = cpu_budget_bytes // spec.block_bytes, f"kv_cache_memory={cpu_budget_bytes}"
    if num < 1:
        raise ValueError(f"no memory left for the KV cache ({why}); lower max_num_batched_tokens "
                         f"or raise the memory budget")
    logger.info("KV cache: %d blocks x %d tokens (%.1f KiB/block, %.1f MiB total) from %s",
                num, spec.block_size, spec.block_bytes / 1024, num * spec.block_bytes / 2**20, why)
    return num


def allocate_kv_caches(spec: KVCacheSpec, num_blocks: int, device: torch.device
                       ) -> list[torch.Tensor]:
    shape = (2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    return [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]
