"""KVCacheManager: each request's block table, grown on demand."""

from __future__ import annotations

from slotserve.core.block_pool import BlockPool


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Maps request ids to the blocks that hold their K/V.

    NOTE: a request with n cached-or-scheduled token positions holds exactly
    ceil(n / block_size) blocks; blocks are taken only when a new position needs one.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        """Fraction of blocks in use."""
        return self.pool.num_used / self.pool.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def allocate_slots(self, request_id: str, num_total_tokens: int) -> list[int] | None:
        """Grow the table so it covers `num_total_tokens` positions.

        Returns the new blocks, or None (and takes nothing) when too few are free.
        """
        table = self.block_tables.setdefault(request_id, [])
        needed = self.blocks_for(num_total_tokens) - len(table)
        if needed <= 0:
            return []
        if needed > self.pool.num_free:
            if not table:
                del self.block_tables[request_id]
            return None
        new_blocks = self.pool.allocate(needed)
        table.extend(new_blocks)
        return new_blocks

    def free(self, request_id: str) -> None:
        """Return all of a request's blocks to the pool (no-op if it holds none)."""
        blocks = self.block_tables.pop(request_id, [])
        # Reversed: the tail blocks go back first, as in vLLM (they are least likely shared).
        self.pool.free(list(reversed(blocks)))

    def check_integrity(self) -> None:
        """Assert tables and pool agree: no block in two tables, held == referenced."""
        self.pool.check_integrity()
        held = [b for table in self.block_tables.values() for b in table]
        assert len(held) == len(set(held)), "a block is in two block tables"
        assert len(held) == self.pool.num_used, (
            f"{len(held)} blocks in tables, {self.pool.num_used} taken from the pool")
