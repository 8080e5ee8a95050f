"""Prefix-cache hits across KV cache groups (vLLM's rule for hybrid models).

A hit of ``m`` leading blocks lets the request compute from token ``m * block_size``: every
full group must hold all ``m`` blocks, and each sliding group only the blocks the next query's
window reaches (from ``first_live_block(m * block_size)`` to ``m``; the earlier ones are never
read). So the full groups' common prefix is shortened to the longest length where every sliding
group still holds its window's tail.
"""
from __future__ import annotations

from collections.abc import Sequence

from pd_cluster.engine.block_hash import block_hash
from pd_cluster.engine.kv_groups import NULL_BLOCK, KVCacheGroup


def leading_run(found: Sequence[int | None]) -> int:
    """How many leading entries are hits."""
    for i, block in enumerate(found):
        if block is None:
            return i
    return len(found)


def accepted_length(groups: Sequence[KVCacheGroup], found: Sequence[Sequence[int | None]],
                    block_size: int) -> int:
    """The longest hit (in blocks) every group can serve. ``found[k][i]``: group k's cached
    block for block i of the request (None: not cached), computed up to a common limit."""
    limit = min((leading_run(f) for g, f in zip(groups, found) if g.window is None),
                default=min((len(f) for f in found), default=0))
    # Per sliding group: run[i] = hits ending at block i (consecutive).
    runs = []
    for group, f in zip(groups, found):
        if group.window is None:
            continue
        run, count = [], 0
        for block in f[:limit]:
            count = count + 1 if block is not None else 0
            run.append(count)
        runs.append((group, run))
    m = limit
    while m > 0 and not all(run[m - 1] >= m - g.first_live_block(m * block_size, block_size)
                            for g, run in runs):
        m -= 1
    return m


def group_hits(groups: Sequence[KVCacheGroup], found: Sequence[Sequence[int | None]], m: int,
               block_size: int) -> list[list[int]]:
    """Each group's table for a hit of ``m`` blocks: the cached blocks, and in a sliding group
    ``NULL_BLOCK`` before the window's first block."""
    tables = []
    for group, f in zip(groups, found):
        first = group.first_live_block(m * block_size, block_size)
        tables.append([NULL_BLOCK] * first + [b for b in f[first:m]])  # type: ignore[misc]
    return tables


def table_lengths(groups: Sequence[KVCacheGroup], num_tokens: int, cached: int,
                  max_new_tokens: int | None, block_size: int) -> list[int]:
    """Each group's table length at admission: a full group covers every current token;
    a sliding group only what the first step computes at most (``max_new_tokens``; None:
    every token), growing step by step."""
    full = -(-num_tokens // block_size)
    if max_new_tokens is None:
        return [full] * len(groups)
    first = -(-min(num_tokens, cached + max(1, max_new_tokens)) // block_size)
    return [full if g.window is None else first for g in groups]


def first_entries(groups: Sequence[KVCacheGroup], num_tokens: int, cached: int,
                  needs_logits: bool, block_size: int) -> list[int]:
    """Per group, the first table entry a request's next query reads (the ones before are
    ``NULL_BLOCK``): after its ``cached`` tokens, or, on a decode engine whose prompt KV comes
    from a producer (no logits computed here), after the whole prompt of ``num_tokens``: a
    sliding group then takes only the blocks of the first decode's window."""
    start = cached if needs_logits else num_tokens
    return [g.first_live_block(start, block_size) for g in groups]


LOWER = -1  # in a group's hits: the block is in a lower KV tier (host or disk), not on device


def tier_key(group: int, chain: int) -> int:
    """The KV tiers' key of group ``group``'s block of chain hash ``chain``: each group's page
    of a prefix block is its own tier entry (group 0's keeps the chain hash, the one prefix
    routing knows; the others' are derived from it, never equal to a chain hash: a token id
    of -1 is no real one)."""
    return chain if group == 0 else block_hash(chain, (-1, group))


def cut_hits(groups: Sequence[KVCacheGroup], tables: Sequence[list[int | None]], cut: int,
             block_size: int) -> tuple[int, list[list[int | None]]]:
    """A hit of ``len(tables[0])`` blocks whose entry ``cut`` cannot be had after all (a
    lower-tier block lost): the longest hit ``m <= cut`` every group still serves from the
    same entries (a sliding group's window tail of ``m`` among its hit entries), and the
    tables of that hit (``NULL_BLOCK`` before each sliding window)."""
    def serves(m: int) -> bool:
        return all(all(t[j] != NULL_BLOCK for j in range(g.first_live_block(m * block_size,
                                                                            block_size), m))
                   for g, t in zip(groups, tables) if g.window is not None)
    m = next(m for m in range(cut, -1, -1) if serves(m))
    out = []
    for g, t in zip(groups, tables):
        first = g.first_live_block(m * block_size, block_size)
        out.append([NULL_BLOCK] * first + list(t[first:m]))
    return m, out
