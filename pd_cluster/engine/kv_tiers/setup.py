"""Sizing the KV tiers from the config, and giving a rank its host store."""
from __future__ import annotations

import logging
from typing import Any

import json
from hashlib import blake2b

from pd_cluster.config import EngineConfig
from pd_cluster.engine.kv_tiers.disk import DiskTier
from pd_cluster.engine.kv_tiers.host_store import HostTierStore

logger = logging.getLogger(__name__)


def tiers_enabled(config: EngineConfig, runner: Any) -> bool:
    """A host tier is configured and this model's blocks can be prefix-cached at all."""
    return bool(config.kv_offloading_size) and runner.model.args.prefix_cacheable


def num_host_slots(config: EngineConfig, rank_block_bytes: int) -> int:
    """Blocks the host tier holds: kv_offloading_size GiB over the engine's ranks (vLLM's
    meaning), each rank holding its own part (its heads) of every block."""
    per_block = rank_block_bytes * config.tensor_parallel_size
    slots = int(config.kv_offloading_size * 2**30) // per_block
    if slots < 1:
        raise ValueError(f"kv_offloading_size: {config.kv_offloading_size} GiB holds no KV "
                         f"block ({per_block} bytes each over the engine's ranks)")
    return slots


def available_host_bytes() -> int | None:
    """The node's MemAvailable (None where /proc/meminfo does not say)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_host_memory(rank_bytes: int, size_gib: float) -> None:
    """A host tier the node cannot hold is a start-up error, not an engine the kernel kills
    (again at every restart) once the tier's memory is committed. Per rank: a rank that
    starts after another sees the memory that one committed."""
    available = available_host_bytes()
    if available is not None and rank_bytes > available:
        raise ValueError(f"kv_offloading_size: {size_gib} GiB of host memory for KV blocks "
                         f"({rank_bytes / 2**30:.1f} GiB on this rank), but this node has "
                         f"{available / 2**30:.1f} GiB available")


def create_disk_tier(config: EngineConfig, runner: Any) -> DiskTier:
    """The disk tier behind rank 0's host store (tensor_parallel_size 1, checked by the
    config); its files carry a fingerprint of everything that makes their bytes mean this
    engine's KV (a file of another model, dtype or block shape is a miss)."""
    from connectors.hello import model_fingerprint
    spec = runner.kv_spec
    what = {"model": model_fingerprint(config.model), "dtype": str(spec.dtype),
            "block_size": spec.block_size, "layers": spec.describe(), "tp_rank": runner.tp.rank,
            "tp_size": config.tensor_parallel_size}
    fingerprint = blake2b(json.dumps(what, sort_keys=True).encode(), digest_size=16).digest()
    disk = config.kv_offloading_disk
    tier = DiskTier(disk.path, disk.size, fingerprint, spec.block_size,
                    runner.tier_store.block_bytes)
    runner.tier_store.disk = tier
    logger.info("KV disk tier: %d blocks in %s", tier.capacity, disk.path)
    return tier


def create_tier_store(config: EngineConfig, runner: Any) -> None:
    """This rank's host store (runner.tier_store), after its device cache exists."""
    if not tiers_enabled(config, runner):
        if config.kv_offloading_size:
            logger.warning("kv_offloading_size ignored: this model's blocks are not "
                           "prefix-cacheable (longrope)")
        return
    slots = num_host_slots(config, runner.kv_spec.block_bytes)
    check_host_memory(slots * runner.kv_spec.block_bytes, config.kv_offloading_size)
    runner.tier_store = HostTierStore(runner.kv_caches, slots)
    logger.info("KV host tier: %d blocks (%.1f MiB on this rank)", slots,
                slots * runner.kv_spec.block_bytes / 2**20)
