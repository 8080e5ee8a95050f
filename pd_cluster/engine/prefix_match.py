"""Prefix-cache hits of one request over every KV cache group: which of its leading full
blocks the device (block_pool.py) or a lower KV tier already holds (block_manager.py turns
the hits into block tables)."""
from __future__ import annotations

from collections.abc import Sequence

from pd_cluster.engine.block_hash import block_hash
from pd_cluster.engine.block_pool import BlockPool
from pd_cluster.engine.group_hits import LOWER, accepted_length, group_hits, tier_key
from pd_cluster.engine.kv_groups import KVCacheGroup
from pd_cluster.engine.kv_tiers.manager import TierManager
from pd_cluster.request import Request


def chain_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    return block_hash(parent_hash, token_ids)


class PrefixMatcher:
    def __init__(self, pool: BlockPool, groups: Sequence[KVCacheGroup], block_size: int,
                 tiers: TierManager | None) -> None:
        self.pool, self.groups, self.block_size, self.tiers = pool, groups, block_size, tiers

    def hits(self, request: Request, needs_logits: bool = True) -> list[list[int | None]]:
        """Per group, the cached blocks matching the request's leading full blocks (the same
        number in every group): a device block id, or None where only a lower tier holds it;
        a sliding group's entries before its window are ``NULL_BLOCK``. With ``needs_logits``
        the last token is never served from cache: the model must run on at least one token
        to produce logits (without: a decode engine whose first token comes from a
        producer)."""
        n = self.matchable(request, needs_logits) // self.block_size
        hashes = self.chain_hashes(request, n)
        found = []
        for k, group in enumerate(self.groups):
            f: list[int | None] = []
            for i in range(n):
                f.append(self._cached(k, hashes[i], request, i))
                if f[-1] is None and group.window is None:
                    break  # a full group's hit ends at its first miss
            found.append(f)
        m = accepted_length(self.groups, found, self.block_size)
        return [[None if b == LOWER else b for b in t]
                for t in group_hits(self.groups, found, m, self.block_size)]

    def _cached(self, group: int, h: int, request: Request, i: int) -> int | None:
        """Group ``group``'s block for block ``i``: a device block, ``LOWER`` (a lower tier
        holds it), or None."""
        tokens = self.block_tokens(request, i)
        block_id = self.pool.lookup(group, h, tokens)
        if block_id is not None:
            return block_id
        if self.tiers is not None and self.tiers.has(tier_key(group, h), tokens):
            return LOWER
        return None

    def block_tokens(self, request: Request, i: int) -> tuple[int, ...]:
        return tuple(request.token_ids_range(i * self.block_size, (i + 1) * self.block_size))

    def chain_hashes(self, request: Request, n: int) -> list[int]:
        """The chain hashes of (at least) the request's first ``n`` full blocks, memoised on
        the request: admission asks several times, and prefix caching for every block."""
        hashes = request.block_hashes
        if len(hashes) < n:
            bs = self.block_size
            tokens = request.token_ids_range(len(hashes) * bs, n * bs)
            parent = hashes[-1] if hashes else None
            for start in range(0, len(tokens), bs):
                parent = chain_hash(parent, tuple(tokens[start:start + bs]))
                hashes.append(parent)
        return hashes

    def matchable(self, request: Request, needs_logits: bool) -> int:
        """Tokens a prefix hit may cover: whole blocks, short of the last token if needed."""
        return (request.num_tokens - needs_logits) // self.block_size * self.block_size
