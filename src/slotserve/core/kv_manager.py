"""KVCacheManager: each request's block table, grown on demand, with prefix caching.

Prefix caching (as vLLM v1): once a full block's K/V are computed, the block is registered
under the hash of its tokens and of everything before them (`block_pool.hash_block`). A
request that starts with the same tokens finds those blocks (`get_computed_blocks`), shares
them, and starts computing after them.

Scope (CacheConfig.prefix_cache_scope): tenant-scoped, the request's tenant starts the hash
chain, so only requests of one tenant share blocks (a tenant cannot learn, from
`cached_tokens` or from timing, what another sent); global, any requests with the same
tokens do. A request's cache_salt narrows either further.

Sliding windows (`sliding_window`: the one window every layer of the model has,
`layer_windows.uniform_window`): a query at position q reads keys q - window + 1 .. q only,
and queries only move forward, so once a request has computed its first q positions, the
blocks that end before q - window + 1 are read by no layer again: they go back to the pool
(vLLM's sliding-window manager). They are always a prefix of the table: the table keeps the
blocks held, and `num_freed_blocks` counts the freed entries before them (vLLM puts its null
block there); `block_table` gives the runner the whole table. A freed block that carries a
hash stays in the prefix cache as a cached free block (evictable, still hittable), as a
request's finished blocks do. A model with mixed windows (some layer attends fully, or the
windows differ) frees nothing.
"""

from __future__ import annotations

from collections import Counter

from slotserve.core.block_pool import BlockHash, BlockPool, hash_block
from slotserve.request import Request
from slotserve.value_checks import is_int


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Maps request ids to the blocks that hold their K/V.

    NOTE: a request with n cached-or-scheduled token positions has exactly
    ceil(n / block_size) table entries (all held, but the freed ones of a sliding window);
    blocks are taken only when a new position needs one.
    NOTE (prefix caching): the first `num_cached_blocks(id)` blocks of a table are full and
    computed, so never written again; only they may be shared or carry a hash. Every block
    after them is held by this one request alone and has no hash. `check_integrity` asserts
    it; the scheduler asserts that a request's computed tokens cover its cached blocks.
    NOTE (sliding window): table indices count the freed entries too (index i holds
    positions i * block_size ..); `block_tables[id]` lists the blocks held, the entries from
    `num_freed_blocks(id)` on. Freed entries are full and computed (so, with prefix caching,
    never more than the cached ones).
    """

    def __init__(self, num_blocks: int, block_size: int,
                 enable_prefix_caching: bool = False, tenant_scoped: bool = False,
                 sliding_window: int | None = None) -> None:
        """tenant_scoped: the tenant is part of every block hash (CacheConfig's
        prefix_cache_scope "tenant"); False: the global scope.
        sliding_window: the window every layer of the model has (`uniform_window` of its
        `sliding_windows`): the blocks before each request's window are freed; None (the
        default): every block is kept until the request ends."""
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.tenant_scoped = tenant_scoped
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}  # the blocks held (after freed entries)
        self._num_freed: dict[str, int] = {}  # leading table entries freed (sliding window)
        self.sliding_window: int | None = None
        self.set_sliding_window(sliding_window)
        self._num_cached_blocks: dict[str, int] = {}
        # Hashes of allocated blocks whose tokens are known but whose K/V are being computed
        # (so another request with that prefix may wait for them instead of computing them).
        self._in_flight: Counter[BlockHash] = Counter()
        self._in_flight_of: dict[str, dict[int, BlockHash]] = {}
        self.prefix_cache_queries = 0  # tokens looked up (a request's length, per admission)
        self.prefix_cache_hits = 0  # of those, tokens found cached

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (cached free blocks count as free: they are evictable)."""
        return self.pool.num_used / self.pool.num_blocks

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries \
            else 0.0

    def blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def set_sliding_window(self, window: int | None) -> None:
        """Free the blocks before each request's last `window` positions from now on (the
        window every layer has), or None: keep every block. Only while no request holds
        blocks; ValueError for a window that is not a positive int."""
        if window is not None and (not is_int(window) or window < 1):
            raise ValueError(f"sliding_window must be a positive integer or None, "
                             f"not {window!r}")
        if self.block_tables:
            raise RuntimeError("the sliding window can change only while no request holds "
                               "blocks")
        self.sliding_window = window

    def num_before_window(self, num_computed_tokens: int) -> int:
        """Leading blocks no query reads once num_computed_tokens positions are computed:
        those that end before the next query's window (0 without a sliding window)."""
        if self.sliding_window is None:
            return 0
        return max(0, num_computed_tokens - self.sliding_window + 1) // self.block_size

    def max_blocks_held(self, num_new_tokens: int) -> int | None:
        """The most blocks a request holds while computing up to num_new_tokens new tokens at
        once (its window's and the new tokens'), or None without a sliding window (then all
        of its positions' blocks)."""
        if self.sliding_window is None:
            return None
        return cdiv(self.sliding_window - 1 + num_new_tokens, self.block_size) + 1

    def hit_blocks_to_hold(self, computed_blocks: list[int]) -> list[int]:
        """The blocks of an admission's hit (`get_computed_blocks`) that the request takes:
        all but those before its first query's window, which it never reads."""
        return computed_blocks[self.num_before_window(len(computed_blocks) * self.block_size):]

    def num_freed_blocks(self, request_id: str) -> int:
        """Leading entries of the request's table whose blocks went back (sliding window)."""
        return self._num_freed.get(request_id, 0)

    def num_table_blocks(self, request_id: str) -> int:
        """Entries of the request's table, freed ones included: its positions need this many
        blocks (0 if it holds none)."""
        held = self.block_tables.get(request_id)
        return 0 if held is None else self.num_freed_blocks(request_id) + len(held)

    def block_table(self, request_id: str) -> list[int]:
        """The request's table as the runner reads it: one block id per entry.

        NOTE: a freed entry repeats the first block held: an id inside the pool, in this
        request's own memory. No attention path reads it (they read only the blocks of a
        query's window: attention/metadata.py, the fused kernels' check_block_tables), and no
        new token is written there (new positions come after the window).
        """
        held = self.block_tables[request_id]
        freed = self.num_freed_blocks(request_id)
        if not freed:
            return list(held)
        return [held[0] if held else 0] * freed + held

    def num_cached_blocks(self, request_id: str) -> int:
        """Leading blocks of the request's table that are full, computed and hash-checked."""
        return self._num_cached_blocks.get(request_id, 0)

    # ----------------------------------------------------------------- hashes and lookups
    def block_hashes(self, request: Request) -> list[BlockHash]:
        """Hashes of the request's full blocks of tokens (computed once, kept on the request)."""
        hashes = request.block_hashes
        num_full = request.num_tokens // self.block_size
        if len(hashes) < num_full:
            tokens = request.all_token_ids
            size = self.block_size
            tenant = request.tenant if self.tenant_scoped else None
            for i in range(len(hashes), num_full):
                parent = hashes[-1] if hashes else None
                hashes.append(hash_block(parent, tokens[i * size:(i + 1) * size],
                                         request.cache_salt, tenant))
        return hashes

    def _max_hit_blocks(self, request: Request) -> int:
        """Blocks a hit may cover: the last token is always computed (its logits are needed),
        and the block it is written into must be the request's own, so whole blocks before it.
        """
        return (request.num_tokens - 1) // self.block_size

    def _longest_hit(self, request: Request, first_block: int) -> list[int]:
        hashes = self.block_hashes(request)
        blocks: list[int] = []
        for block_hash in hashes[first_block:self._max_hit_blocks(request)]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The longest cached prefix of a request that holds no blocks: (blocks, tokens).

        A pure lookup: it takes nothing (pass the blocks to `allocate_slots`).
        """
        if not self.enable_prefix_caching:
            return [], 0
        blocks = self._longest_hit(request, 0)
        return blocks, len(blocks) * self.block_size

    def next_block_in_flight(self, request: Request, num_blocks_held: int) -> bool:
        """Whether the block after the request's first `num_blocks_held` blocks could be a
        hit, but another request is computing it now (so waiting for it saves its compute)."""
        if not self._in_flight or num_blocks_held >= self._max_hit_blocks(request):
            return False
        hashes = self.block_hashes(request)
        return self._in_flight[hashes[num_blocks_held]] > 0

    # ----------------------------------------------------------------- taking blocks
    def allocate_slots(self, request: Request, num_total_tokens: int,
                       computed_blocks: list[int] | None = None) -> list[int] | None:
        """Grow the table so it covers `num_total_tokens` positions.

        computed_blocks: for a request being admitted, `get_computed_blocks`'s blocks (maybe
        none): they start its table (shared) and the lookup counts as a prefix-cache query.
        Returns the new blocks, or None (and takes nothing) when too few are free.
        """
        request_id = request.request_id
        held = self.num_table_blocks(request_id)
        if computed_blocks is None:  # NOTE: most decodes: the blocks held cover them
            if request_id in self.block_tables and self.blocks_for(num_total_tokens) <= held:
                return []
        computed = computed_blocks or []
        if computed and held:
            raise RuntimeError(f"{request_id}: cached blocks given to a request holding blocks")
        needed = max(0, self.blocks_for(num_total_tokens) - held - len(computed))
        # NOTE: touching a free cached block takes it out of the free queues too.
        taken = self.hit_blocks_to_hold(computed)
        if needed + self.pool.num_free_among(taken) > self.pool.num_free:
            return None
        table = self.block_tables.setdefault(request_id, [])
        if computed_blocks is not None and self.enable_prefix_caching:
            self._take_hit(request, computed)
            self.prefix_cache_queries += request.num_tokens
        new_blocks = self.pool.allocate(needed)
        table.extend(new_blocks)
        self._mark_in_flight(request, self.num_table_blocks(request_id) - needed)
        return new_blocks

    def extend_computed(self, request: Request) -> int:
        """Share cached blocks right after a running request's computed prefix.

        Only a request whose blocks are all computed and full can take more (nothing of its
        own is allocated past them). Returns the tokens gained; the caller advances
        `num_computed_tokens` by that much.
        """
        if not self.enable_prefix_caching or request.request_id not in self.block_tables:
            return 0
        num_entries = self.num_table_blocks(request.request_id)
        if request.num_computed_tokens != num_entries * self.block_size:
            return 0
        blocks = self._longest_hit(request, num_entries)
        self._take_hit(request, blocks)
        return len(blocks) * self.block_size

    def _take_hit(self, request: Request, blocks: list[int]) -> None:
        """Append cached blocks to the table of a request whose entries are all cached.

        NOTE (sliding window): the entries that end before the window of the first query
        after the hit are freed at once: held ones go back, hit ones are never taken.
        """
        request_id = request.request_id
        entries = self.num_table_blocks(request_id)
        assert self.num_cached_blocks(request_id) == entries
        table = self.block_tables[request_id]
        freed = self.num_freed_blocks(request_id)
        out = max(freed, self.num_before_window((entries + len(blocks)) * self.block_size))
        gone = table[:max(0, min(out, entries) - freed)]
        del table[:len(gone)]
        taken = blocks[max(0, out - entries):]
        self.pool.touch(taken)
        table.extend(taken)
        self.pool.free(list(reversed(gone)))
        if out:
            self._num_freed[request_id] = out
        self._num_cached_blocks[request_id] = entries + len(blocks)
        hit_tokens = len(blocks) * self.block_size
        self.prefix_cache_hits += hit_tokens
        if request.num_preemptions == 0 and not request.output_token_ids:
            request.num_cached_tokens += hit_tokens

    def _mark_in_flight(self, request: Request, first_new: int) -> None:
        """Record the hashes of new blocks that will fill with already-known tokens."""
        if not self.enable_prefix_caching:
            return
        hashes = self.block_hashes(request)
        num_entries = self.num_table_blocks(request.request_id)
        marks = self._in_flight_of.setdefault(request.request_id, {})
        for index in range(first_new, min(num_entries, len(hashes))):
            marks[index] = hashes[index]
            self._in_flight[hashes[index]] += 1

    def _end_in_flight(self, request_id: str, index: int | None = None) -> None:
        marks = self._in_flight_of.get(request_id, {})
        ended = list(marks) if index is None else [index] if index in marks else []
        for i in ended:
            block_hash = marks.pop(i)
            self._in_flight[block_hash] -= 1
            if self._in_flight[block_hash] == 0:
                del self._in_flight[block_hash]

    # ----------------------------------------------------------------- computed, freed
    def cache_full_blocks(self, request: Request) -> None:
        """Register the blocks that `num_computed_tokens` has just filled (after a forward).

        Generated tokens count too, so a conversation's next turn hits the previous answer.
        """
        request_id = request.request_id
        table = self.block_tables.get(request_id)
        if not self.enable_prefix_caching or table is None:
            return
        start = self.num_cached_blocks(request_id)
        freed = self.num_freed_blocks(request_id)
        num_full = min(request.num_computed_tokens // self.block_size, freed + len(table))
        if num_full <= start:
            return
        assert freed <= start, f"{request_id}: a freed block was never cached"
        hashes = self.block_hashes(request)
        for index in range(start, num_full):
            self._end_in_flight(request_id, index)
            # False: a duplicate, kept plain
            self.pool.cache_block(table[index - freed], hashes[index])
        self._num_cached_blocks[request_id] = num_full

    def on_computed(self, request: Request) -> None:
        """After a forward advanced `num_computed_tokens`: register the blocks it filled
        (prefix caching), then give back the blocks no later query reads (sliding window)."""
        self.cache_full_blocks(request)
        self.free_outside_window(request)

    def free_outside_window(self, request: Request) -> int:
        """Give back the blocks that end before the window of the request's next query
        (position `num_computed_tokens`, reading keys from num_computed_tokens - window + 1
        on). Returns how many went back; 0 without a sliding window.

        NOTE: queries only move forward (speculative decoding rewinds only past positions it
        had not computed; a preempted request gives back all its blocks and starts again),
        so a block freed here is never read again. The attention paths read from the same
        first block: (context_len - window) // block_size with context_len = the query's
        position + 1 (metadata.py's views, the kernels' first_window_position).
        """
        request_id = request.request_id
        table = self.block_tables.get(request_id)
        if self.sliding_window is None or table is None:
            return 0
        freed = self.num_freed_blocks(request_id)
        # NOTE: with prefix caching, only blocks whose hash was registered (or refused as a
        # duplicate) go: cache_full_blocks runs first (on_computed), so this caps nothing
        # unless a caller skipped it.
        limit = self.num_cached_blocks(request_id) if self.enable_prefix_caching else \
            freed + len(table)
        num_free = min(self.num_before_window(request.num_computed_tokens), limit) - freed
        if num_free <= 0:
            return 0
        gone = table[:num_free]
        del table[:num_free]
        self._num_freed[request_id] = freed + num_free
        # Reversed, as in free(): the later blocks go back first, the earlier stay cached
        # longer (a prefix hit needs the earliest blocks of the chain).
        self.pool.free(list(reversed(gone)))
        return num_free

    def trim(self, request: Request, num_tokens: int) -> int:
        """Give back the blocks past the first ceil(num_tokens / block_size) of a request's
        table (speculative decoding: blocks taken for draft tokens that were rejected).
        Returns how many went back.

        NOTE: only a request's own unhashed tail goes back (never a cached block: those hold
        computed, accepted tokens before num_tokens), so it keeps the invariant that a
        request holds exactly the blocks its cached-or-scheduled positions need.
        """
        request_id = request.request_id
        table = self.block_tables.get(request_id)
        keep = self.blocks_for(num_tokens)
        if table is None or self.num_table_blocks(request_id) <= keep:
            return 0
        if keep < max(self.num_cached_blocks(request_id), self.num_freed_blocks(request_id)):
            raise RuntimeError(f"{request_id}: trimming to {num_tokens} tokens would drop "
                               "cached or freed blocks")
        keep_held = keep - self.num_freed_blocks(request_id)
        tail = table[keep_held:]
        del table[keep_held:]
        for index in range(keep, keep + len(tail)):
            self._end_in_flight(request_id, index)
        self.pool.free(list(reversed(tail)))
        return len(tail)

    def free(self, request_id: str) -> None:
        """Return all of a request's blocks to the pool (no-op if it holds none)."""
        blocks = self.block_tables.pop(request_id, [])
        self._num_freed.pop(request_id, None)
        self._num_cached_blocks.pop(request_id, None)
        self._end_in_flight(request_id)
        self._in_flight_of.pop(request_id, None)
        # Reversed: the tail blocks go back first, as in vLLM (they are least likely shared,
        # so the LRU order evicts them first).
        self.pool.free(list(reversed(blocks)))

    def reset_prefix_cache(self) -> int:
        """Drop the cached free blocks (the prefix cache forgets them; running requests keep
        their blocks). Returns how many blocks were dropped."""
        return self.pool.reset_prefix_cache()

    def check_integrity(self) -> None:
        """Assert tables and pool agree: ref counts, the cached/exclusive split, in-flight,
        freed entries (only with a sliding window; with prefix caching, only cached ones)."""
        self.pool.check_integrity()
        refs: Counter[int] = Counter()
        for request_id, table in self.block_tables.items():
            assert len(table) == len(set(table)), f"{request_id}: a block twice in its table"
            refs.update(table)
            cached = self.num_cached_blocks(request_id)
            freed = self.num_freed_blocks(request_id)
            entries = freed + len(table)
            assert cached <= entries, f"{request_id}: {cached} cached of {entries}"
            assert freed == 0 or self.sliding_window is not None, (
                f"{request_id}: {freed} blocks freed without a sliding window")
            assert not self.enable_prefix_caching or freed <= cached, (
                f"{request_id}: {freed} freed but {cached} cached blocks")
            for block in table[max(0, cached - freed):]:
                assert self.pool.ref_count(block) == 1, f"block {block} is writable but shared"
                assert self.pool.hash_of(block) is None, f"block {block} is writable but hashed"
            for index in self._in_flight_of.get(request_id, {}):
                assert cached <= index < entries, f"{request_id}: in-flight block {index}"
        for block in range(self.pool.num_blocks):
            assert self.pool.ref_count(block) == refs[block], (
                f"block {block}: ref count {self.pool.ref_count(block)}, "
                f"in {refs[block]} tables")
        assert set(self._num_cached_blocks) <= set(self.block_tables)
        assert set(self._num_freed) <= set(self.block_tables)
        assert set(self._in_flight_of) <= set(self.block_tables)
        expected = Counter(h for marks in self._in_flight_of.values() for h in marks.values())
        assert expected == self._in_flight, "in-flight counts disagree"
