"""KV cache groups through P/D: which of a request's block tables holds a layer's KV.

An engine with groups (pd_cluster/engine/kv_groups.py) keeps one block table per group; a
layer reads and writes its group's. Table entry i means tokens [i * block_size, (i + 1) *
block_size) in every group, so the wire's block indices (``first_block``) are the same
whatever either engine's groups: only the block ids differ. The producer ships a layer from
its own group's table, the consumer writes it into its own group's (and a sliding group's
entries before the first decode's window are the null block there: never shipped, never
written). Without groups the one table serves every layer (``group_block_ids`` empty).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, TypeVar

T = TypeVar("T")


def request_tables(request: Any) -> tuple[tuple[int, ...], ...]:
    """The request's per-group tables, or () with one table (no groups)."""
    tables = getattr(request, "group_block_ids", None) or []
    return tuple(tuple(t) for t in tables) if len(tables) > 1 else ()


def layer_table(block_ids: Sequence[T], group_block_ids: Sequence[Sequence[T]],
                layer_groups: Sequence[int] | None, layer: int) -> Sequence[T]:
    """``layer``'s table: its group's with groups, else ``block_ids`` (the one table)."""
    if not group_block_ids or not layer_groups or layer >= len(layer_groups):
        return block_ids
    return group_block_ids[layer_groups[layer]]


def spec_for_layer(spec: Any, layer_groups: Sequence[int] | None, layer: int) -> Any:
    """A SendSpec whose ``block_ids`` are ``layer``'s group's (the per-group ids dropped, so
    the producer's slicing of block_ids applies to the layer's own table)."""
    if not spec.group_block_ids:
        return spec
    return dataclasses.replace(spec, block_ids=tuple(layer_table(
        spec.block_ids, spec.group_block_ids, layer_groups, layer)), group_block_ids=())


def grant_groups_valid(block_ids: Sequence[int], group_block_ids: Sequence[Sequence[int]],
                       layer_groups: Sequence[int]) -> bool:
    """A consumer's per-group grant (it comes from a peer): every group as long as
    ``block_ids`` and every layer naming one of them; none at all is valid too."""
    if not group_block_ids and not layer_groups:
        return True
    return (bool(group_block_ids) and bool(layer_groups)
            and all(len(ids) == len(block_ids) for ids in group_block_ids)
            and all(0 <= g < len(group_block_ids) for g in layer_groups))
