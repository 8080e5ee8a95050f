"""Which producer rank sends which KV heads to which consumer rank, for any two TP sizes.

A rank of a TP-``size`` engine caches a contiguous slice of the model's ``num_kv_heads`` KV
heads (``size / num_kv_heads`` ranks share one head when there are fewer heads than ranks).
Each consumer rank gets exactly the heads it owns: for every head it needs, one producer rank
holding that head sends it (replicated heads are sent once per consumer rank, by one holder,
spread over the holders). Routes are computed per producer rank from the two sizes alone, so
both sides agree without exchanging more than (size, num_kv_heads).

An engine with several ranks advertises one KV endpoint per rank, joined by ``|`` in rank
order; a TP1 engine's endpoint is its rank's, unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass

SEP = "|"


def split_endpoint(endpoint: str) -> list[str]:
    return endpoint.split(SEP)


def join_endpoints(endpoints: list[str]) -> str:
    return SEP.join(endpoints)


def heads_of(rank: int, size: int, num_kv_heads: int) -> range:
    """Global KV heads cached by ``rank`` of a TP-``size`` engine."""
    if size >= num_kv_heads:
        h = rank // (size // num_kv_heads)
        return range(h, h + 1)
    per = num_kv_heads // size
    return range(rank * per, (rank + 1) * per)


def check_layout(size: int, num_kv_heads: int, what: str) -> None:
    if size % num_kv_heads and num_kv_heads % size:
        raise ValueError(f"{what}: tensor_parallel_size={size} and num_key_value_heads="
                         f"{num_kv_heads}: one must divide the other")


@dataclass(frozen=True)
class Route:
    """Producer-local heads [src, src + count) go to consumer rank ``dst_rank``'s local heads
    [dst, dst + count)."""
    dst_rank: int
    src: int
    dst: int
    count: int


def _holder(head: int, consumer_rank: int, p_size: int, num_kv_heads: int) -> int:
    holders = [r for r in range(p_size) if head in heads_of(r, p_size, num_kv_heads)]
    return holders[consumer_rank % len(holders)]


def routes_for(p_rank: int, p_size: int, d_size: int, num_kv_heads: int) -> list[Route]:
    """What producer rank ``p_rank`` sends, one Route per (consumer rank, contiguous heads)."""
    check_layout(p_size, num_kv_heads, "prefill engine")
    check_layout(d_size, num_kv_heads, "decode engine")
    mine = heads_of(p_rank, p_size, num_kv_heads)
    out: list[Route] = []
    for d_rank in range(d_size):
        wanted = heads_of(d_rank, d_size, num_kv_heads)
        heads = [h for h in wanted if _holder(h, d_rank, p_size, num_kv_heads) == p_rank]
        if heads:  # contiguous by construction (both sides slice heads in order)
            out.append(Route(d_rank, heads[0] - mine.start, heads[0] - wanted.start,
                             len(heads)))
    return out


def num_feeders(d_rank: int, p_size: int, d_size: int, num_kv_heads: int) -> int:
    """How many producer ranks send to consumer rank ``d_rank`` (each sends it a FIN)."""
    return len({_holder(h, d_rank, p_size, num_kv_heads)
                for h in heads_of(d_rank, d_size, num_kv_heads)})
