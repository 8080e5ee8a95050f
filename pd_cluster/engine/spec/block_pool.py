"""A proposer's own KV block pool (the draft model's, a hidden-state head's): a free list of
block ids, grown per request and given back whole; its leak check is a count."""
from __future__ import annotations


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() takes the lowest

    def grow(self, blocks: list[int], num_tokens: int) -> bool:
        """Extend ``blocks`` (in place) to hold ``num_tokens``; False (unchanged) if the pool
        cannot."""
        need = -(-num_tokens // self.block_size) - len(blocks)
        if need > len(self.free):
            return False
        for _ in range(max(need, 0)):
            blocks.append(self.free.pop())
        return True

    def release(self, blocks: list[int]) -> None:
        self.free.extend(reversed(blocks))
        blocks.clear()

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)
