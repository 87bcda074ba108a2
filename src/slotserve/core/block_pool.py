"""BlockPool: a fixed set of KV blocks handed out and taken back by id."""

from __future__ import annotations

from collections import deque


class BlockPool:
    """Free queue and reference counts of `num_blocks` KV blocks.

    NOTE: a block id is either in the free queue (ref count 0) or held (ref count >= 1),
    never both; `check_integrity` asserts it.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, count: int) -> list[int]:
        """Take `count` free blocks (lowest ids first after a fresh start)."""
        if count > len(self._free):
            raise RuntimeError(f"asked for {count} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(count)]
        for block in blocks:
            self._ref_counts[block] = 1
        return blocks

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; blocks that reach zero return to the queue."""
        for block in blocks:
            if self._ref_counts[block] <= 0:
                raise RuntimeError(f"block {block} freed twice")
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free.append(block)

    def check_integrity(self) -> None:
        """Assert every block is free xor referenced, and none is queued twice."""
        free = set(self._free)
        assert len(free) == len(self._free), "a block is queued twice"
        for block, refs in enumerate(self._ref_counts):
            assert refs >= 0, f"block {block} has ref count {refs}"
            in_queue = block in free
            assert (refs == 0) == in_queue, f"block {block}: refs {refs}, queued {in_queue}"
