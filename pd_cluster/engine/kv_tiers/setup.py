"""Sizing the KV tiers from the config, and giving a rank its host store."""
from __future__ import annotations

import json
import logging
from hashlib import blake2b
from pathlib import Path
from typing import Any

from pd_cluster.config import EngineConfig
from pd_cluster.engine.kv_tiers.disk import DiskTier
from pd_cluster.engine.kv_tiers.host_store import HostTierStore
from pd_cluster.engine.kv_tiers.manager import TierManager

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


# A checkpoint's weight files (every shard, and the index that names them).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".index.json")


def checkpoint_fingerprint(model_dir: str | Path) -> str:
    """Identifies the checkpoint whose KV the disk tier keeps: config.json's bytes and every
    weight file's name, size and mtime_ns (cheap: no weight is read). A fine-tune saved under
    the same path changes some shard's size or mtime, so the old KV files are misses; a copy
    of the same weights elsewhere (new mtimes) only costs a cold disk tier."""
    root = Path(model_dir)
    h = blake2b(root.joinpath("config.json").read_bytes(), digest_size=16)
    for f in sorted(p for p in root.iterdir() if p.name.endswith(WEIGHT_SUFFIXES)):
        st = f.stat()  # through a symlink: the shard's own size and time
        h.update(f"\0{f.name}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return h.hexdigest()


def create_disk_tier(config: EngineConfig, runner: Any) -> DiskTier:
    """The disk tier behind rank 0's host store (tensor_parallel_size 1, checked by the
    config); its files carry a fingerprint of everything that makes their bytes mean this
    engine's KV (a file of another checkpoint, dtype or block shape is a miss)."""
    spec = runner.kv_spec
    what = {"model": checkpoint_fingerprint(config.model), "dtype": str(spec.dtype),
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


def tier_manager(config: EngineConfig, runner: Any) -> TierManager | None:
    """The engine's KV tiers (None: no host tier on this engine)."""
    store = runner.tier_store
    if store is None:
        return None
    disk = create_disk_tier(config, runner) if config.kv_offloading_disk is not None else None
    return TierManager(store.host[0].shape[0],
                       store.block_bytes * config.tensor_parallel_size, disk)
