"""The replica router (slotserve.scaleout.router): pure Python, no Ray."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from slotserve.scaleout.router import HashRing, Router, block_chain_hashes

NAMES = ["r0", "r1", "r2", "r3"]


def test_block_chain_hashes_cover_full_blocks_and_share_prefixes():
    a = block_chain_hashes(list(range(40)), 16)
    b = block_chain_hashes(list(range(32)) + [99] * 20, 16)
    assert len(a) == 2 and len(b) == 3  # 40 tokens: 2 full blocks; 52: 3
    assert a == b[:2]
    assert block_chain_hashes([5, 1] + list(range(30)), 16)[0] != a[0]
    assert block_chain_hashes(list(range(15)), 16) == []
    with pytest.raises(ValueError, match="block_size"):
        block_chain_hashes([1], 0)


def test_hash_ring_is_stable_and_moves_only_a_removed_replicas_keys():
    keys = [i.to_bytes(4, "little") for i in range(2000)]
    ring = HashRing(NAMES)
    owners = {k: ring.owner(k) for k in keys}
    assert owners == {k: HashRing(list(reversed(NAMES))).owner(k) for k in keys}
    spread = Counter(owners.values())
    assert set(spread) == set(NAMES) and min(spread.values()) > 2000 / 4 / 2
    without = set(NAMES) - {"r2"}
    for k in keys:
        moved = ring.owner(k, without)
        assert moved == owners[k] if owners[k] != "r2" else moved in without
    assert ring.owner(keys[0], set()) is None


def _prompt(seed: int, length: int = 64) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(length)]


def test_prefix_policy_follows_a_conversation_and_its_first_block_owner():
    router = Router(NAMES, 16, "prefix", rng=random.Random(0))
    loads = dict.fromkeys(NAMES, 0)
    first = router.pick(_prompt(1), loads)
    assert first.reason == "hash"
    assert first.replica == router.ring.owner(block_chain_hashes(_prompt(1), 16)[0], set(NAMES))
    turn2 = router.pick(_prompt(1) + _prompt(2, 40), loads)
    assert turn2 == type(first)(first.replica, "affinity")
    # a replica that is down is skipped; its affinity is forgotten
    del loads[first.replica]
    assert router.pick(_prompt(1) + _prompt(3, 40), loads).replica != first.replica


def test_prefix_policy_leaves_an_overloaded_replica_by_power_of_two():
    for seed in range(20):
        router = Router(NAMES, 16, "prefix", load_margin=4, rng=random.Random(seed))
        affine = router.pick(_prompt(7), dict.fromkeys(NAMES, 0)).replica
        loads = {name: 2 for name in NAMES}
        loads[affine] = 6  # exactly the margin above the least loaded: stays
        assert router.pick(_prompt(7), loads) == type(router.pick([1], loads))(affine,
                                                                               "affinity")
        loads[affine] = 7  # past the margin: two random replicas, the less loaded
        moved = router.pick(_prompt(7), loads)
        assert moved.reason == "load" and moved.replica != affine
        # the conversation now follows the replica it moved to
        assert router.pick(_prompt(7) + [1] * 16, loads) == type(moved)(moved.replica,
                                                                         "affinity")


def test_power_of_two_prefers_the_less_loaded_of_two_draws():
    router = Router(NAMES, 16, rng=random.Random(1))
    loads = {"r0": 0, "r1": 5, "r2": 9, "r3": 9}
    picks = Counter(router.power_of_two(loads) for _ in range(600))
    assert picks["r0"] == max(picks.values())
    assert picks["r1"] > picks["r2"] + picks["r3"]  # r1 wins 2 of its 3 pairs, r2/r3 none
    assert picks["r2"] + picks["r3"] < 150  # only drawn together (1 pair in 6), tie
    # r0 wins every draw it is in (half of the 6 pairs): about 300 of 600
    assert 200 < picks["r0"] < 400
    assert Router(["only"], 16).power_of_two({"only": 3}) == "only"


def test_short_prompts_round_robin_and_least_loaded():
    router = Router(NAMES, 16, "prefix", rng=random.Random(0))
    assert router.pick([1, 2, 3], dict.fromkeys(NAMES, 0)).reason == "short"
    rr = Router(NAMES, 16, "round_robin")
    assert [rr.pick([1], dict.fromkeys(NAMES, 0)).replica for _ in range(5)] == [
        "r0", "r1", "r2", "r3", "r0"]
    ll = Router(NAMES, 16, "least_loaded")
    assert ll.pick([1], {"r0": 3, "r1": 1, "r2": 1}).replica == "r1"


def test_bad_router_arguments_are_refused():
    with pytest.raises(ValueError, match="policy"):
        Router(NAMES, 16, "random")
    with pytest.raises(ValueError, match="at least one"):
        Router([], 16)
    with pytest.raises(ValueError, match="no replica is up"):
        Router(NAMES, 16).pick([1], {})
