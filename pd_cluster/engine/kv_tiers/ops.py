"""One step's KV tier operations: what the scheduler decided, what every rank executes.

They travel in the step's StepInput (msgpack to tensor-parallel workers) and run at the very
start of the step, before the connector binds its metadata (a consumer may write received KV
into freshly allocated blocks) and before the forward, in this order:
1. spills: copy host slots that are about to be reused to the disk writer (their old bytes),
2. saves: device block -> host slot (blocks evicted from the device pool this step; the
   forward may overwrite them next),
3. fills: a disk block's verified payload -> host slot (tensor parallel size 1 only),
4. loads: host slot -> device block (prefix hits in a lower tier).
A host slot is touched by at most one op that writes it per step (the manager pins it), so
this order is all the synchronisation the ops need.
"""
from __future__ import annotations

import msgspec


class Spill(msgspec.Struct, array_like=True):
    """Host slot ``slot`` (holding ``block_hash`` of ``token_ids``) goes to disk."""
    slot: int
    block_hash: int
    token_ids: list[int]


class TierOps(msgspec.Struct, forbid_unknown_fields=True):
    spills: list[Spill] = []
    saves: list[tuple[int, int]] = []  # (device block, host slot)
    fills: list[tuple[int, bytes]] = []  # (host slot, payload read from disk)
    loads: list[tuple[int, int]] = []  # (host slot, device block)

    @property
    def empty(self) -> bool:
        return not (self.spills or self.saves or self.fills or self.loads)
