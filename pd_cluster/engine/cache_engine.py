"""Per-layer paged KV tensors and the decision of how many blocks fit."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from pd_cluster.engine.kv_groups import KVCacheGroup, layer_slots
from pd_cluster.engine.kv_spec import FullAttentionSpec, LayerKVSpec

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVCacheSpec:
    """The whole paged cache: ``block_size`` tokens per block, one spec per layer (what each
    layer's attention caches, see kv_spec.py), and the layers' groups (kv_groups.py; none
    given: one group of every layer, where a block id means the same tokens in every layer
    and only its bytes differ by layer)."""
    block_size: int
    layers: tuple[LayerKVSpec, ...]
    groups: tuple[KVCacheGroup, ...] = ()

    @classmethod
    def uniform(cls, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                dtype: torch.dtype) -> "KVCacheSpec":
        """Every layer full attention with the same heads."""
        return cls(block_size, (FullAttentionSpec(num_kv_heads, head_dim, dtype),) * num_layers)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].dtype

    @property
    def kv_groups(self) -> tuple[KVCacheGroup, ...]:
        return self.groups or (KVCacheGroup(tuple(range(self.num_layers))),)

    @property
    def block_bytes(self) -> int:
        """Bytes one block id occupies: its page in each layer of a group (one group: every
        layer, the sum of their pages)."""
        return sum(self.layers[i].page_bytes(self.block_size) for i in self.kv_groups[0].layers)

    @property
    def token_bytes(self) -> float:
        """Bytes one token takes over every layer when every layer holds it."""
        return sum(layer.page_bytes(self.block_size) for layer in self.layers) / self.block_size

    def describe(self) -> list[dict[str, Any]]:
        return [layer.describe() for layer in self.layers]


@dataclass(frozen=True)
class DeviceMemory:
    """What the KV cache is sized from on a GPU (bytes). ``own_bytes`` is this engine's
    non-KV memory (its weights), not the process's: several engines may share a process or
    a GPU, and each one's cache is its own business."""
    total: int
    free: int
    own_bytes: int
    peak_activation_bytes: int = 0
    reserved_bytes: int = 0  # the KV connector's device buffers (NCCL, staging)

    @classmethod
    def measure(cls, device: torch.device, own_bytes: int, peak_activation_bytes: int,
                reserved_bytes: int) -> "DeviceMemory":
        free, total = torch.cuda.mem_get_info(device)
        return cls(total, free, own_bytes, peak_activation_bytes, reserved_bytes)

    def kv_budget(self, utilization: float) -> int:
        """This engine's share (utilization x total) minus what it needs besides the cache,
        and never more than is free now (other engines and processes hold the rest)."""
        extra = self.peak_activation_bytes + self.reserved_bytes
        return min(int(self.total * utilization) - self.own_bytes - extra, self.free - extra)


def determine_num_blocks(spec: KVCacheSpec, device: torch.device, num_kv_blocks: int | None,
                         cpu_budget_bytes: int, gpu_memory_utilization: float,
                         memory: DeviceMemory | None = None) -> int:
    if num_kv_blocks is not None:
        num, why = num_kv_blocks, "num_kv_blocks"
    elif device.type == "cuda" or memory is not None:
        if memory is None:
            raise RuntimeError("a GPU's KV cache is sized from a DeviceMemory report; none given")
        num = max(memory.kv_budget(gpu_memory_utilization), 0) // spec.block_bytes
        why = (f"gpu_memory_utilization={gpu_memory_utilization} of "
               f"{memory.total / 2**30:.1f} GiB ({memory.free / 2**30:.1f} GiB free), weights "
               f"{memory.own_bytes / 2**30:.2f} GiB, peak activations "
               f"{memory.peak_activation_bytes / 2**30:.2f} GiB, KV connector buffers "
               f"{memory.reserved_bytes / 2**30:.2f} GiB")
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
    """One tensor per layer, shaped by its own spec; with groups, layer j of every group
    shares tensor j (a block id is a page of the group that holds it)."""
    if len(spec.kv_groups) == 1:
        return [torch.zeros(layer.cache_shape(num_blocks, spec.block_size), dtype=layer.dtype,
                            device=device) for layer in spec.layers]
    first = spec.kv_groups[0].layers
    shared = [torch.zeros(spec.layers[i].cache_shape(num_blocks, spec.block_size),
                          dtype=spec.layers[i].dtype, device=device) for i in first]
    return [shared[j] for j in layer_slots(spec.kv_groups, spec.num_layers)]
