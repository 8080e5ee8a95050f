"""KV cache groups (vLLM's hybrid allocator): layers of one kind share a block table.

Full-attention layers keep every block of a request; a sliding-window layer only needs the
blocks its window reaches. Layers are split by kind (full; sliding with its window) into
groups of ``g`` layers each (g: the gcd of the kinds' layer counts, so each kind splits
evenly; Gemma 3 at 48 layers: 8 full + 40 sliding, g = 8, six groups; gpt-oss: one of each).
The cache is ``g`` tensors: tensor ``j`` holds layer ``j`` of every group, so a block id is a
page of ``g`` layers in whichever group's table took it, and the pool stays single.

A sliding group's table keeps its length (entry i: tokens [i*bs, (i+1)*bs)); entries wholly
before the window of the next query point at block ``NULL_BLOCK``, reserved, never handed out
and never read (every attention kernel starts at the window's first block).

One group of every layer, with no window, is the layout before groups (and the one used
where groups are off: a draft model still shares the target's whole-model block ids).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

NULL_BLOCK = 0  # a sliding group's released entries point here


@dataclass(frozen=True)
class KVCacheGroup:
    """``layers``: the model layers whose caches this group's table addresses, in tensor-slot
    order; ``window``: their sliding window in tokens (None: full attention)."""
    layers: tuple[int, ...]
    window: int | None = None

    def first_live_block(self, tokens: int, block_size: int) -> int:
        """The first block a query at position ``tokens`` (the next one computed) reads: keys
        k with tokens - window < k, from token tokens - window + 1 (0: full attention)."""
        if self.window is None:
            return 0
        return max(0, tokens - self.window + 1) // block_size

    def blocks_held(self, tokens: int, chunk: int, block_size: int) -> int:
        """Blocks this group holds at most while computing ``chunk`` tokens at a time of a
        sequence of ``tokens`` (the window before the chunk, then the chunk)."""
        total = -(-tokens // block_size)
        if self.window is None:
            return total
        return min(total, -(-(self.window - 1 + chunk) // block_size) + 1)


def _kind_key(spec: Any) -> tuple:
    return tuple(sorted(spec.describe().items()))


def _page_key(spec: Any) -> tuple:
    return (spec.parts, spec.heads, spec.width, spec.dtype)


def make_groups(layers: Sequence[Any], enabled: bool = True) -> tuple[KVCacheGroup, ...]:
    """The groups of these layer specs (kv_spec.py); one group of every layer, no window,
    when ``enabled`` is False or the kinds' pages differ in shape (they could not share a
    tensor). Full groups first: group 0 is then the one whose hashes prefix routing sees."""
    everything = (KVCacheGroup(tuple(range(len(layers)))),)
    if not enabled or not layers:
        return everything
    kinds: dict[tuple, list[int]] = {}
    for i, spec in enumerate(layers):
        kinds.setdefault(_kind_key(spec), []).append(i)
    if len({_page_key(layers[idx[0]]) for idx in kinds.values()}) > 1:
        return everything

    def window(i: int) -> int | None:
        return getattr(layers[i], "window", None) if layers[i].kind == "sliding" else None

    g = math.gcd(*(len(idx) for idx in kinds.values()))
    order = sorted(kinds.values(), key=lambda idx: (window(idx[0]) is not None,
                                                    window(idx[0]) or 0, idx[0]))
    return tuple(KVCacheGroup(tuple(idx[s:s + g]), window(idx[0]))
                 for idx in order for s in range(0, len(idx), g))


def layer_slots(groups: Sequence[KVCacheGroup], num_layers: int) -> list[int]:
    """Per layer: the cache tensor (its position in its group) it lives in."""
    slots = [0] * num_layers
    for group in groups:
        for j, layer in enumerate(group.layers):
            slots[layer] = j
    return slots


def layer_groups(groups: Sequence[KVCacheGroup], num_layers: int) -> list[int]:
    """Per layer: the index of its group (whose block table it reads)."""
    of = [0] * num_layers
    for k, group in enumerate(groups):
        for layer in group.layers:
            of[layer] = k
    return of


def has_sliding(groups: Sequence[KVCacheGroup]) -> bool:
    return any(g.window is not None for g in groups)
