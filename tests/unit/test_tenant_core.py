"""Tenants cannot see or starve each other in the engine's core (issue 29, items 1, 3, 5, 6,
7): the tenant-scoped prefix cache, deadline's prefill floor and SLO bounds, the per-tenant
slot shares (scheduler + a fake runner on a fake clock, no torch) and AsyncEngine's
per-tenant waiting bound (a tiny model)."""

from __future__ import annotations

import asyncio
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slotserve.config import (
    CacheConfig,
    SchedulerConfig,
    check_policy_fields,
    resolve_prefix_cache_scope,
)
from slotserve.core.block_pool import hash_block
from slotserve.core.kv_manager import KVCacheManager
from slotserve.core.outputs import RunnerOutput, SchedulerOutput
from slotserve.core.scheduler import Scheduler
from slotserve.request import Request
from slotserve.sampling import SamplingParams

PER_TOKEN_S = 0.001  # the fake clock: every batched token takes 1 ms


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_scheduler(num_blocks=256, block_size=4, tenant_scoped=False, **kwargs) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=True,
                        tenant_scoped=tenant_scoped)
    return Scheduler(SchedulerConfig(**kwargs), kv, clock=FakeClock())


def request(rid: str, prompt: list[int], max_tokens: int, tenant: str = "default",
            **fields) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return Request(rid, list(prompt), params, tenant=tenant, **fields)


def add(sched: Scheduler, rid: str, prompt_len: int, max_tokens: int, tenant: str = "default",
        **fields) -> Request:
    # Distinct first tokens: no prefix-cache hits between requests.
    prompt = [len(sched.requests) + 1 + 100 * len(rid)] + list(range(1000, 999 + prompt_len))
    req = request(rid, prompt, max_tokens, tenant, **fields)
    req.times.arrival = sched.clock()
    sched.add_request(req)
    return req


def step(sched: Scheduler) -> SchedulerOutput:
    """One iteration; the fake clock advances PER_TOKEN_S per batched token."""
    plan = sched.schedule()
    sched.clock.now += PER_TOKEN_S * plan.num_batched_tokens
    sched.update(plan, RunnerOutput(sampled={s.request_id: 7 for s in plan.seqs if s.sample}))
    sched.check_integrity()
    return plan


def run_to_end(sched: Scheduler, max_steps: int = 20_000) -> None:
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return
        step(sched)
    raise AssertionError("the workload did not finish")


def running_of(sched: Scheduler, tenant: str) -> int:
    return sum(1 for r in sched.running if r.tenant == tenant)


# ---------------------------------------------------------------------- prefix cache scope
def test_tenant_scoped_hashes_differ_by_tenant_and_keep_the_global_ones():
    tokens = [1, 2, 3, 4]
    assert hash_block(None, tokens, None, "A") != hash_block(None, tokens, None, "B")
    assert hash_block(None, tokens, None, "A") != hash_block(None, tokens, None)
    assert hash_block(None, tokens, "s", "A") != hash_block(None, tokens, None, "A")
    # NOTE: tagged and length-prefixed: a tenant cannot pose as another tenant plus a salt
    assert hash_block(None, tokens, "b", "a") != hash_block(None, tokens, None, "ab")


def test_the_global_scopes_hashes_are_unchanged():
    """Without a tenant a block hashes as before the scope existed (sha256 of the tagged
    empty root, then the token ids)."""
    import hashlib
    from array import array

    digest = hashlib.sha256()
    digest.update(b"root" + (0).to_bytes(8, "little"))
    digest.update(array("q", [1, 2, 3, 4]).tobytes())
    assert hash_block(None, [1, 2, 3, 4], None) == digest.digest()


def _hit_tokens(sched: Scheduler, rid: str, prompt: list[int], tenant: str,
                cache_salt: str | None = None) -> int:
    req = request(rid, prompt, 1, tenant, cache_salt=cache_salt)
    sched.add_request(req)
    run_to_end(sched)
    return req.num_cached_tokens


@pytest.mark.parametrize("tenant_scoped, b_hits", [(True, 0), (False, 12)])
def test_another_tenant_never_hits_a_tenants_blocks(tenant_scoped, b_hits):
    sched = make_scheduler(tenant_scoped=tenant_scoped)
    prompt = list(range(10, 26))  # 16 tokens: 3 full blocks can hit (the last is computed)
    assert _hit_tokens(sched, "a1", prompt, "A") == 0
    assert _hit_tokens(sched, "b1", prompt, "B") == b_hits
    assert _hit_tokens(sched, "a2", prompt, "A") == 12  # the tenant's own blocks: a hit
    # A salt narrows within the tenant.
    assert _hit_tokens(sched, "a3", prompt, "A", cache_salt="s") == 0
    assert _hit_tokens(sched, "a4", prompt, "A", cache_salt="s") == 12


def test_the_n_completions_of_one_request_share_under_the_tenant_scope():
    sched = make_scheduler(tenant_scoped=True)
    prompt = list(range(10, 26))
    children = [request(f"r#{i}", prompt, 2, "A") for i in range(4)]
    for child in children:
        sched.add_request(child)
    run_to_end(sched)
    # One computed the prompt; the others shared its blocks (waited for them in flight).
    assert sorted(c.num_cached_tokens for c in children) == [0, 12, 12, 12]


def test_the_scope_setting():
    assert CacheConfig().prefix_cache_scope == "auto" and not CacheConfig().tenant_scoped
    assert CacheConfig(prefix_cache_scope="tenant").tenant_scoped
    with pytest.raises(ValueError, match="prefix_cache_scope"):
        CacheConfig(prefix_cache_scope="everyone")
    assert resolve_prefix_cache_scope("auto", keys_required=True) == "tenant"
    assert resolve_prefix_cache_scope("auto", keys_required=False) == "global"
    assert resolve_prefix_cache_scope("global", keys_required=True) == "global"
    assert resolve_prefix_cache_scope("tenant", keys_required=False) == "tenant"


def test_the_replay_hashes_as_the_engine_does():
    from slotserve.lab.replay.runner import VirtualEngineCore
    from slotserve.lab.replay.simulator import ReplaySettings

    for scope, scoped in [("tenant", True), ("global", False), ("auto", False)]:
        settings_ = ReplaySettings(prefix_cache_scope=scope)
        core = VirtualEngineCore(settings_.scheduler_config(), settings_.cache_config(),
                                 cost_model=None)
        assert core.kv.tenant_scoped is scoped


# ---------------------------------------------------------------------- deadline floors
def test_a_tiny_tpot_slo_does_not_stop_another_tenants_prefill():
    sched = make_scheduler(scheduling_policy="deadline", max_num_batched_tokens=64)
    sched.cost.observe(1000, 1000 * PER_TOKEN_S)  # 1 ms per token
    add(sched, "hog", 4, 200, tenant="B", slo_tpot_ms=0.001)
    step(sched)  # the hog has its first token: it decodes from now on
    victim = add(sched, "victim", 5, 1, tenant="A")
    plans = []
    while victim.times.first_token is None:
        plans.append(step(sched))
        assert len(plans) <= 3, "the victim's prefill was stopped"
    # One block (4 tokens) per iteration beside the hog's decode: 5 tokens in 2 iterations.
    assert [[s.num_tokens for s in p.seqs if s.request_id == "victim"] for p in plans] == [
        [4], [1]]
    assert sched.requests["hog"].slo_tpot_ms == 1.0  # raised to the floor


def test_slos_are_raised_to_the_floors_and_bounded_above():
    sched = make_scheduler(min_slo_ttft_ms=50, min_slo_tpot_ms=20, slo_tpot_ms=5)
    a = add(sched, "a", 4, 1, slo_ttft_ms=0.001)
    b = add(sched, "b", 4, 1, slo_ttft_ms=900, slo_tpot_ms=30)
    assert (a.slo_ttft_ms, a.slo_tpot_ms) == (50, 20)
    assert (b.slo_ttft_ms, b.slo_tpot_ms) == (900, 30)
    for field in ("slo_ttft_ms", "slo_tpot_ms"):
        with pytest.raises(ValueError, match=field):
            check_policy_fields(0, "t", **{"slo_ttft_ms": None, "slo_tpot_ms": None,
                                           field: 3_600_001})
        with pytest.raises(ValueError, match=field):
            SchedulerConfig(**{field: 1e300})
        with pytest.raises(ValueError, match=field):
            add(sched, f"huge-{field}", 4, 1, **{field: 1e300})
    check_policy_fields(0, "t", 3_600_000, 3_600_000)  # one hour exactly: allowed
    with pytest.raises(ValueError, match="min_slo_tpot_ms"):
        SchedulerConfig(min_slo_tpot_ms=0)


# ---------------------------------------------------------------------- slot shares
def _hog_all_slots(sched: Scheduler, tenant: str = "B", n: int = 32) -> list[Request]:
    prompt = list(range(500, 520))
    hogs = [request(f"hog#{i}", prompt, 300, tenant) for i in range(n)]
    for hog in hogs:
        sched.add_request(hog)
    for _ in range(10):
        step(sched)
    assert running_of(sched, tenant) == sched.config.max_num_seqs
    return hogs


@pytest.mark.parametrize("policy", ["fcfs", "priority", "deadline", "fair"])
def test_a_request_with_n_32_on_32_slots_gives_another_tenant_a_slot(policy):
    sched = make_scheduler(num_blocks=4096, max_num_seqs=32, scheduling_policy=policy)
    hogs = _hog_all_slots(sched)
    newest = sched.running[-1]
    victim = add(sched, "victim", 6, 3, tenant="A")
    plan = step(sched)
    assert victim.times.first_token is not None  # in the very next iteration
    assert plan.preempted == [newest.request_id]  # the hog's newest gave its slot up
    assert running_of(sched, "B") == 31
    run_to_end(sched)
    assert all(h.num_preemptions <= 1 for h in hogs)


def test_one_tenant_alone_uses_every_slot():
    sched = make_scheduler(max_num_seqs=8)
    for i in range(12):
        add(sched, f"r{i}", 4, 20, tenant="A")
    step(sched)
    assert len(sched.running) == 8 and sched.num_preemptions == 0


def test_a_tenant_over_its_share_is_not_admitted_while_another_waits():
    sched = make_scheduler(max_num_seqs=4, max_num_batched_tokens=64)
    for i in range(4):
        add(sched, f"b{i}", 4, 20, tenant="B")
    step(sched)
    assert running_of(sched, "B") == 4  # alone, B uses every slot
    for i in range(4):
        add(sched, f"a{i}", 4, 3, tenant="A")
    late = add(sched, "b-late", 4, 3, tenant="B")  # fcfs: ahead of nothing of A's...
    step(sched)
    # ...A's first two preempt B's two newest: 2 slots each.
    assert (running_of(sched, "A"), running_of(sched, "B")) == (2, 2)
    while any(r.tenant == "A" for r in sched.waiting):
        assert running_of(sched, "B") <= 2 and late.times.scheduled is None
        step(sched)
    run_to_end(sched)


def test_weights_set_the_shares():
    sched = make_scheduler(max_num_seqs=8, tenant_weights={"A": 3})
    for i in range(8):
        add(sched, f"b{i}", 4, 50, tenant="B")
    step(sched)
    for i in range(8):
        add(sched, f"a{i}", 4, 50, tenant="A")
    for _ in range(8):
        step(sched)
    assert (running_of(sched, "A"), running_of(sched, "B")) == (6, 2)  # 8 x 3/4, 8 x 1/4


def test_priority_preempts_across_tenants_only_through_the_shares():
    sched = make_scheduler(max_num_seqs=2, scheduling_policy="priority")
    a0 = add(sched, "a0", 4, 50, tenant="A", priority=5)
    b0 = add(sched, "b0", 4, 50, tenant="B", priority=5)
    step(sched)
    # A holds its share (1 of 2 slots): its most urgent request preempts A's own
    # lower-priority request, never B's.
    urgent = add(sched, "a-urgent", 4, 5, tenant="A", priority=-2_000_000_000)
    plan = step(sched)
    assert plan.preempted == ["a0"] and urgent.times.first_token is not None
    assert b0.num_preemptions == 0 and a0.num_preemptions == 1
    # Equal priorities never preempt each other (as before).
    again = add(sched, "a-equal", 4, 5, tenant="A", priority=-2_000_000_000)
    step(sched)
    assert again.times.scheduled is None and sched.num_preemptions == 1
    run_to_end(sched)
    assert b0.num_preemptions == 0


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), policy=st.sampled_from(["fcfs", "priority", "deadline",
                                                            "fair"]),
       slots=st.integers(1, 8), num_tenants=st.integers(1, 4))
def test_no_tenant_stays_over_its_share_while_one_below_it_waits(seed, policy, slots,
                                                                 num_tenants):
    """Random arrivals of several tenants (memory and budget ample, so only slots are
    short): after every plan, a tenant over its share and a waiting tenant below its share
    never coexist; everything finishes; the scheduler's invariants hold throughout."""
    rng = random.Random(seed)
    weights = {f"t{i}": rng.choice([1, 1, 2, 3]) for i in range(num_tenants)}
    sched = make_scheduler(num_blocks=4096, max_num_seqs=slots, max_num_batched_tokens=4096,
                           scheduling_policy=policy, tenant_weights=weights,
                           slo_ttft_ms=rng.choice([None, 50, 500]))
    arrivals = sorted(rng.randrange(60) for _ in range(8 * num_tenants))
    for it in range(20_000):
        while arrivals and arrivals[0] <= it:
            arrivals.pop(0)
            tenant = f"t{rng.randrange(num_tenants)}"
            add(sched, f"r{len(sched.requests)}-{it}-{rng.random()}", rng.randint(1, 12),
                rng.randint(1, 10), tenant=tenant, priority=rng.randint(-2, 2))
        if not arrivals and not sched.has_unfinished():
            break
        plan = sched.schedule()
        shares = sched.load.shares()
        if shares is not None:
            over = [t for t, n in sched.load.running.items() if n > shares[t]]
            hungry = [t for t in sched.load.waiting if sched.load.entitled(t, shares)]
            assert not (over and hungry), (over, hungry, shares)
        sched.clock.now += PER_TOKEN_S * plan.num_batched_tokens
        sched.update(plan, RunnerOutput(sampled={s.request_id: 7 for s in plan.seqs
                                                 if s.sample}))
        sched.check_integrity()
    assert not sched.has_unfinished() and not arrivals


# ---------------------------------------------------------------------- waiting bound
async def _admit(engine, request_id: str, n: int, tenant: str) -> None:
    """Open a stream on an engine whose thread is not running: it stays queued (returns)
    or is refused (raises)."""
    outputs = engine.generate(request_id, [5, 6, 7], SamplingParams(n=n, max_tokens=1),
                              tenant=tenant)
    first = asyncio.ensure_future(anext(outputs))
    await asyncio.sleep(0.01)
    if first.done():
        first.result()  # the refusal
        raise AssertionError("an output without an engine thread")
    first.cancel()  # the consumer leaves; its sequences stay queued as a command


def test_each_tenant_has_its_own_weighted_waiting_bound(tiny_llama):
    from slotserve.engine.async_engine import AsyncEngine, QueueFullError
    from tests.conftest import tiny_engine

    engine = AsyncEngine(tiny_engine(tiny_llama, num_blocks=16, max_waiting_per_tenant=4,
                                     tenant_weights={"heavy": 2}))

    async def scenario():
        await _admit(engine, "b1", 3, "B")
        await _admit(engine, "b2", 1, "B")
        with pytest.raises(QueueFullError) as refused:
            await _admit(engine, "b3", 1, "B")
        # The message names the tenant's own bound only: nothing of what others queue.
        assert str(refused.value) == ("your waiting requests are at their bound (4 sequences "
                                      "waiting for a slot, --max-waiting-per-tenant)")
        await _admit(engine, "a1", 4, "A")  # B's full queue does not touch A's
        await _admit(engine, "h1", 8, "heavy")  # weight 2: twice the bound
        with pytest.raises(QueueFullError):
            await _admit(engine, "h2", 1, "heavy")
        with pytest.raises(ValueError, match="n=5 completions can never be queued"):
            await _admit(engine, "a-big", 5, "C")

    asyncio.run(scenario())


def test_the_global_bound_says_nothing_of_what_others_queue(tiny_llama):
    from slotserve.engine.async_engine import AsyncEngine, QueueFullError
    from tests.conftest import tiny_engine

    engine = AsyncEngine(tiny_engine(tiny_llama, num_blocks=16, max_waiting=4))

    async def scenario():
        await _admit(engine, "b1", 3, "B")
        with pytest.raises(QueueFullError) as refused:
            await _admit(engine, "a1", 2, "A")
        assert str(refused.value) == ("the server's waiting queue is full (at most 4 "
                                      "sequences, --max-waiting)")
        assert "3" not in str(refused.value)

    asyncio.run(scenario())


def test_the_per_tenant_bound_counts_the_schedulers_waiting_sequences(tiny_llama):
    """Once the engine has a tenant's sequences waiting (and preempted ones), they count."""
    from tests.conftest import tiny_engine

    engine = tiny_engine(tiny_llama, num_blocks=64, max_num_seqs=1)
    engine.add_request("run", [5, 6, 7], SamplingParams(max_tokens=50), tenant="B")
    engine.step()
    engine.add_request("wait", [5, 6, 8], SamplingParams(max_tokens=1, n=3), tenant="B")
    assert (engine.num_waiting_of("B"), engine.num_waiting_of("A")) == (3, 0)
