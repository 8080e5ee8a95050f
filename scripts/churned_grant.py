"""Block ids as our engine's pool hands them out after churn, for bench_kv_transfer.py's
nixl and shm parts (issue 42): a grant's layout (how many runs of consecutive blocks) decides
how many NIXL descriptors and separate copies a transfer takes.

``churned_blocks`` runs the engine's own BlockManager through a serving history (requests of
any size from 1/64 to 1/2 of the pool arriving and finishing at random), then frees live
requests in random order until the wanted blocks are free, and returns the blocks it gives a
request of that size: what a decode engine that has been serving for a while grants (or a
prefill engine holds). Deterministic per seed. Importable with scripts/ on sys.path.
"""
from __future__ import annotations

import random

from pd_cluster.engine.block_manager import BlockManager
from pd_cluster.request import Request
from pd_cluster.sampling_params import SamplingParams


def churned_blocks(num_blocks: int, want: int, block_size: int = 16, seed: int = 0,
                   steps: int = 400) -> list[int]:
    """``want`` block ids (table order) from a pool of ``num_blocks`` after ``steps`` steps of
    churn."""
    if not 0 < want <= num_blocks - 1:
        raise ValueError(f"want: 1..{num_blocks - 1} blocks, got {want}")
    rng = random.Random(seed)
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
    live: list[tuple[Request, int]] = []

    def request(blocks: int, n: int) -> Request:
        return Request(f"churn-{n}", [1] * (blocks * block_size), SamplingParams(max_tokens=1))

    for step in range(steps):
        if rng.random() < 0.5:
            r = request(rng.randint(max(1, num_blocks // 64), num_blocks // 2), step)
            if bm.can_allocate(r):
                bm.allocate(r)
                live.append((r, step + rng.randint(2, 40)))
        for r, end in [x for x in live if x[1] <= step]:
            bm.free(r)
            live.remove((r, end))
    rng.shuffle(live)
    while bm.num_free_blocks < want:
        bm.free(live.pop()[0])
    r = request(want, steps)
    bm.allocate(r)
    return list(r.block_ids)


def num_runs(ids: list[int]) -> int:
    """Runs of consecutive ascending ids."""
    return 1 + sum(1 for a, b in zip(ids, ids[1:]) if b != a + 1) if ids else 0
