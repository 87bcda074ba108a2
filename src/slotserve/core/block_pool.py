"""BlockPool: a fixed set of KV blocks handed out and taken back by id, with a prefix cache.

A block whose K/V are computed for a full block of tokens may be registered under that
block's hash (see `hash_block`). Another request with the same hash can then share it
(`touch`) instead of computing it again. When its last holder frees it, a hashed block keeps
its K/V and its hash: it waits in an LRU queue and can still be hit, until the pool needs
the memory and evicts it.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque

BlockHash = bytes


def hash_block(parent: BlockHash | None, token_ids: list[int], cache_salt: str | None,
               tenant: str | None = None) -> BlockHash:
    """Stable hash of one full block: its parent's hash, its token ids, the request's salt
    and (tenant-scoped prefix caching) its tenant.

    NOTE: stable across processes (sha256, not Python's salted `hash`). The salt and the
    tenant are mixed into the first block only; every later block chains its parent, so it
    inherits them. Each is tagged and length-prefixed, so no (tenant, salt) pair collides
    with another; without a tenant the hash is the global scope's (unchanged).
    """
    digest = hashlib.sha256()
    if parent is None:
        if tenant is not None:
            _update_tagged(digest, b"tenant", tenant)
        if cache_salt is None:
            _update_tagged(digest, b"root", "")
        else:
            _update_tagged(digest, b"salt", cache_salt)
    else:
        digest.update(parent)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


def _update_tagged(digest, tag: bytes, text: str) -> None:
    data = text.encode()
    digest.update(tag)
    digest.update(len(data).to_bytes(8, "little"))
    digest.update(data)


class BlockPool:
    """Reference counts, free queues and the hash -> block map of `num_blocks` KV blocks.

    Free blocks wait in two queues: `_free_plain` (no hash: nothing to lose) and
    `_free_cached` (a hash: still hittable), in least-recently-freed order. `allocate` takes
    plain blocks first and evicts cached ones (LRU head first) only when no plain block is
    left, so the cache keeps as much as memory allows. (vLLM v1 keeps one queue and takes its
    head; this order evicts later, at the price of a second queue.)

    NOTE: a block id is either free (ref count 0, in exactly one queue) or held (ref count
    >= 1, in no queue); a block has a hash iff the map maps that hash to it; a queued block
    has a hash iff it is in `_free_cached`. `check_integrity` asserts all of it.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free_plain: deque[int] = deque(range(num_blocks))
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        self._ref_counts = [0] * num_blocks
        self._hash_of: list[BlockHash | None] = [None] * num_blocks
        self._cached: dict[BlockHash, int] = {}
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks `allocate` can hand out (cached free blocks are evicted on demand)."""
        return len(self._free_plain) + len(self._free_cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks registered under a hash (held or free)."""
        return len(self._cached)

    @property
    def num_cached_free(self) -> int:
        """Free blocks that still hold cached K/V (evicted on demand)."""
        return len(self._free_cached)

    def cached_free_blocks(self) -> list[int]:
        """The free blocks that still hold cached K/V, least recently freed first."""
        return list(self._free_cached)

    def reset_prefix_cache(self) -> int:
        """Forget the hash of every free cached block (they become plain free blocks).

        Blocks held by requests keep theirs. Returns how many blocks were dropped.
        """
        dropped = list(self._free_cached)
        for block in dropped:
            del self._cached[self._hash_of[block]]
            self._hash_of[block] = None
        self._free_plain.extend(dropped)
        self._free_cached.clear()
        return len(dropped)

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    def hash_of(self, block: int) -> BlockHash | None:
        return self._hash_of[block]

    def allocate(self, count: int) -> list[int]:
        """Take `count` free blocks: never-hashed ones first (lowest ids first after a fresh
        start), then the least recently freed cached ones, whose hash is dropped."""
        if count > self.num_free:
            raise RuntimeError(f"asked for {count} blocks, {self.num_free} free")
        blocks = []
        for _ in range(count):
            if self._free_plain:
                block = self._free_plain.popleft()
            else:
                block, _ = self._free_cached.popitem(last=False)
                self._evict(block)
            self._ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def _evict(self, block: int) -> None:
        del self._cached[self._hash_of[block]]
        self._hash_of[block] = None
        self.num_evictions += 1

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The block registered under this hash, held or free, or None."""
        return self._cached.get(block_hash)

    def touch(self, blocks: list[int]) -> None:
        """Take one more reference to each (cached) block; a free one leaves its queue."""
        for block in blocks:
            if self._ref_counts[block] == 0:
                del self._free_cached[block]  # KeyError: it was not a cached block
            self._ref_counts[block] += 1

    def num_free_among(self, blocks: list[int]) -> int:
        """How many of these blocks are free now (touching them would take them)."""
        return sum(1 for block in blocks if self._ref_counts[block] == 0)

    def cache_block(self, block: int, block_hash: BlockHash) -> bool:
        """Register a held, fully computed block under its hash.

        Returns False (and registers nothing) when another block holds that hash already:
        two requests computed the same block at once; the first one keeps the entry.
        """
        if self._ref_counts[block] < 1:
            raise RuntimeError(f"block {block} is free; only held blocks can be cached")
        if self._hash_of[block] is not None:
            raise RuntimeError(f"block {block} is cached already")
        if block_hash in self._cached:
            return False
        self._cached[block_hash] = block
        self._hash_of[block] = block_hash
        return True

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; blocks that reach zero join a free queue."""
        for block in blocks:
            if self._ref_counts[block] <= 0:
                raise RuntimeError(f"block {block} freed twice")
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                if self._hash_of[block] is None:
                    self._free_plain.append(block)
                else:
                    self._free_cached[block] = None

    def check_integrity(self) -> None:
        """Assert every block is free xor referenced, queued once, and the map is exact."""
        plain = set(self._free_plain)
        assert len(plain) == len(self._free_plain), "a block is queued twice"
        cached_free = set(self._free_cached)
        assert not plain & cached_free, "a block is in both free queues"
        for block, refs in enumerate(self._ref_counts):
            assert refs >= 0, f"block {block} has ref count {refs}"
            in_queue = block in plain or block in cached_free
            assert (refs == 0) == in_queue, f"block {block}: refs {refs}, queued {in_queue}"
            block_hash = self._hash_of[block]
            if block in plain:
                assert block_hash is None, f"plain free block {block} has a hash"
            if block in cached_free:
                assert block_hash is not None, f"cached free block {block} has no hash"
            if block_hash is not None:
                assert self._cached.get(block_hash) == block, f"block {block}: map disagrees"
        assert len(self._cached) == sum(h is not None for h in self._hash_of), (
            "the hash map names a block that has no hash")
