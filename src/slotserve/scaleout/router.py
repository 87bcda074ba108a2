"""Which replica serves a request: round robin, least loaded, or cache- and load-aware.

Pure Python (no Ray): the replica set's ingress asks `Router.pick(prompt_ids, loads)` for
each request, with the replicas that are up and their loads.

The `prefix` policy (the default) sends a prompt where its first KV blocks are most likely
cached already:

1. Affinity: the prompt's full blocks (`block_size` tokens each, as the engines' prefix
   cache keys them) are hashed as a chain, h1 = H(block 1), h2 = H(h1, block 2), ... The
   router remembers, for the chain hashes of the prompts it routed, which replica got them
   (a bounded LRU table). A new prompt goes to the replica of its longest remembered chain
   prefix: a conversation's next turn starts with the previous turn's prompt, so it follows
   it. A prompt with no remembered prefix goes to its first block's owner on a consistent
   hash ring (so identical system prompts meet on one replica, and adding or losing a
   replica moves only that replica's share).
2. Load: if the affine replica's load (sequences waiting + running there) exceeds the
   least loaded replica's by more than `load_margin`, the request goes by power-of-two
   choices on load instead (two replicas drawn at random, the less loaded wins).

A prompt shorter than one block cannot hit a cache: it goes by power-of-two choices.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import random
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

POLICIES = ("prefix", "least_loaded", "round_robin")
DEFAULT_LOAD_MARGIN = 4  # sequences
DEFAULT_VIRTUAL_NODES = 64  # points per replica on the hash ring
DEFAULT_AFFINITY_ENTRIES = 100_000  # chain hashes remembered (about 100 bytes each)
MAX_AFFINITY_BLOCKS = 64  # a prompt's leading blocks that are hashed (bounds the cost)


@dataclass(frozen=True)
class Choice:
    """A routing decision: the replica and why (logged, traced, counted)."""

    replica: str
    reason: str  # "affinity" | "hash" | "load" | "short" | "least_loaded" | "round_robin"


def block_chain_hashes(prompt_ids: Sequence[int], block_size: int,
                       max_blocks: int = MAX_AFFINITY_BLOCKS) -> list[bytes]:
    """The chain hashes of the prompt's full blocks (at most `max_blocks`): the i-th
    covers tokens [0, (i + 1) * block_size)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    hashes, previous = [], b""
    for i in range(min(len(prompt_ids) // block_size, max_blocks)):
        block = prompt_ids[i * block_size:(i + 1) * block_size]
        digest = hashlib.blake2b(previous, digest_size=16)
        digest.update(array("q", block).tobytes())  # NOTE: one C call per block
        previous = digest.digest()
        hashes.append(previous)
    return hashes


class HashRing:
    """Consistent hashing of keys onto replica names (`virtual_nodes` points each).

    NOTE: a key's owner depends only on the set of names, not on their order, and removing
    a name moves only the keys it owned.
    """

    def __init__(self, names: Sequence[str], virtual_nodes: int = DEFAULT_VIRTUAL_NODES) -> None:
        if virtual_nodes < 1:
            raise ValueError(f"virtual_nodes must be >= 1, got {virtual_nodes}")
        points = sorted((_point(f"{name}#{i}".encode()), name)
                        for name in set(names) for i in range(virtual_nodes))
        self._keys = [p for p, _ in points]
        self._names = [n for _, n in points]

    def owner(self, key: bytes, available: set[str] | None = None) -> str | None:
        """The first name at or after the key's point that is in `available` (default:
        any); None if none is."""
        if not self._keys:
            return None
        start = bisect.bisect_left(self._keys, _point(key))
        for step in range(len(self._keys)):
            name = self._names[(start + step) % len(self._keys)]
            if available is None or name in available:
                return name
        return None


def _point(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class Router:
    """Picks a replica per request by `policy` (one of POLICIES); see the module doc.

    Not thread-safe: the ingress calls it from its event loop only.
    """

    def __init__(self, replicas: Sequence[str], block_size: int, policy: str = "prefix", *,
                 load_margin: int = DEFAULT_LOAD_MARGIN,
                 affinity_entries: int = DEFAULT_AFFINITY_ENTRIES,
                 rng: random.Random | None = None) -> None:
        if policy not in POLICIES:
            raise ValueError(f"router policy must be one of {POLICIES}, got {policy!r}")
        if not replicas:
            raise ValueError("a router needs at least one replica")
        if load_margin < 0:
            raise ValueError(f"load_margin must be >= 0, got {load_margin}")
        self.replicas = list(replicas)
        self.block_size = block_size
        self.policy = policy
        self.load_margin = load_margin
        self.ring = HashRing(self.replicas)
        self._affinity: OrderedDict[bytes, str] = OrderedDict()
        self._affinity_entries = affinity_entries
        self._rng = rng or random.Random()
        self._turn = itertools.count()

    def pick(self, prompt_ids: Sequence[int], loads: dict[str, int]) -> Choice:
        """The replica for a prompt; `loads`: the replicas that are up -> their load.
        ValueError if none is up."""
        if not loads:
            raise ValueError("no replica is up")
        if self.policy == "round_robin":
            return Choice(self._round_robin(loads), "round_robin")
        if self.policy == "least_loaded":
            return Choice(min(sorted(loads), key=loads.__getitem__), "least_loaded")
        return self._prefix(prompt_ids, loads)

    def _round_robin(self, loads: dict[str, int]) -> str:
        up = [name for name in self.replicas if name in loads]
        return up[next(self._turn) % len(up)]

    def _prefix(self, prompt_ids: Sequence[int], loads: dict[str, int]) -> Choice:
        chain = block_chain_hashes(prompt_ids, self.block_size)
        if not chain:
            return Choice(self.power_of_two(loads), "short")
        affine, reason = self._remembered(chain, loads), "affinity"
        if affine is None:
            affine, reason = self.ring.owner(chain[0], set(loads)), "hash"
        if loads[affine] > min(loads.values()) + self.load_margin:
            chosen, reason = self.power_of_two(loads), "load"
        else:
            chosen = affine
        self._remember(chain, chosen)
        return Choice(chosen, reason)

    def power_of_two(self, loads: dict[str, int]) -> str:
        """Two replicas drawn at random; the less loaded (the first drawn on a tie)."""
        names = sorted(loads)
        if len(names) == 1:
            return names[0]
        a, b = self._rng.sample(names, 2)
        return b if loads[b] < loads[a] else a

    def _remembered(self, chain: list[bytes], loads: dict[str, int]) -> str | None:
        """The up replica that got the longest remembered prefix of this chain."""
        for key in reversed(chain):
            name = self._affinity.get(key)
            if name is not None and name in loads:
                return name
        return None

    def _remember(self, chain: list[bytes], replica: str) -> None:
        for key in chain:
            self._affinity[key] = replica
            self._affinity.move_to_end(key)
        while len(self._affinity) > self._affinity_entries:
            self._affinity.popitem(last=False)

    def forget(self, replica: str) -> None:
        """Drop the affinities to a replica (it restarted: its cache is empty)."""
        for key in [k for k, name in self._affinity.items() if name == replica]:
            del self._affinity[key]
