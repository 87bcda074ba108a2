"""Per-tenant slot shares (SchedulerConfig.tenant_slot_share): no tenant starves another.

A tenant's share of the slots is max_num_seqs x its weight / the summed weights of the
tenants that have work (a sequence running or waiting), rounded up, at least 1 slot. A
tenant is *entitled* to one more slot while it runs fewer sequences than its share, and
*over* its share while it runs more. While an entitled tenant has a sequence waiting:

- a tenant that is not entitled is not admitted (its waiting requests are skipped, whatever
  the queue order says), and
- with no slot free, the entitled tenant's request preempts (recompute) a running sequence
  of the tenant furthest over its share: the last one in running order (the one its policy
  gives up first; fcfs: the newest).

So a request with n=32 on 32 slots gives up a slot to another tenant's request within the
iteration that request is first considered. When no tenant with waiting work is entitled
(more tenants than slots, or every one at its share), free slots go to anyone: the rule
never leaves a slot idle that nobody is entitled to. With one tenant it never binds.

NOTE (rounding up): the shares may add up to more than the slots (2 slots, weights 1 and 3:
1 and 2), so a tenant may wait below its share for a slot to free, but no tenant is held
below its weight's share by another's rounding: rounding down (or a fractional share) held
the weight-3 tenant to 1 of 2 slots, and `fair`'s service gap grew to 3.6x VTC's bound in
tests/unit/test_policies.py's workloads (rounded up: within it).
NOTE: each preemption moves one slot from a tenant over its share to one that stays within
its share, so the total overage strictly falls and planning an iteration terminates; a
preempted sequence's tenant is not entitled afterwards, so it cannot preempt back.
"""

from __future__ import annotations

import math
from collections import Counter

from slotserve.config import SchedulerConfig
from slotserve.request import Request

_EPS = 1e-9  # a share that is a whole number of slots, computed in floats, stays one


class TenantLoad:
    """Running and waiting sequences per tenant (the scheduler moves them), and the shares
    and decisions they give.

    NOTE: a tenant with no sequence has no key in either counter; `Scheduler.check_integrity`
    asserts both agree with the running batch and the waiting queue. Reading a count from
    another thread is safe (one dict lookup): AsyncEngine bounds each tenant's waiting
    sequences with `num_waiting`.
    """

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self._weights = dict(config.tenant_weights)  # unnamed tenants weigh 1
        self.running: Counter[str] = Counter()
        self.waiting: Counter[str] = Counter()

    # ----------------------------------------------------------------- bookkeeping
    def num_waiting(self, tenant: str) -> int:
        return self.waiting.get(tenant, 0)

    def move(self, tenant: str, *, running: int = 0, waiting: int = 0) -> None:
        """Add (or, negative, take) running and waiting sequences of `tenant`."""
        for counter, delta in ((self.running, running), (self.waiting, waiting)):
            if delta:
                counter[tenant] += delta
                if counter[tenant] <= 0:
                    assert counter[tenant] == 0, f"{tenant}: negative count"
                    del counter[tenant]

    # ----------------------------------------------------------------- shares
    def shares(self) -> dict[str, int] | None:
        """Each tenant-with-work's share of the slots (rounded up, at least 1); None when
        the rule cannot bind (it is off, or at most one tenant has work)."""
        if not self.config.tenant_slot_share:
            return None
        active = self.running.keys() | self.waiting.keys()
        if len(active) < 2:
            return None
        weights = {tenant: self._weights.get(tenant, 1.0) for tenant in active}
        total = sum(weights.values())
        slots = self.config.max_num_seqs
        return {tenant: max(1, math.ceil(slots * weight / total - _EPS))
                for tenant, weight in weights.items()}

    def entitled(self, tenant: str, shares: dict[str, int]) -> bool:
        """Whether one more running sequence keeps the tenant within its share."""
        return self.running.get(tenant, 0) < shares[tenant]

    def blocked(self, shares: dict[str, int]) -> set[str]:
        """Tenants not to admit now: not entitled, while an entitled tenant waits."""
        if not any(self.entitled(tenant, shares) for tenant in self.waiting):
            return set()
        return {tenant for tenant in shares if not self.entitled(tenant, shares)}

    def share_victims(self, candidate: Request, running: list[Request],
                      shares: dict[str, int]) -> list[Request]:
        """Running sequences to preempt for an entitled tenant's waiting request, the first
        to go first: tenants by how far over their share (most first), each one's last in
        running order first. None if the candidate's tenant is not entitled."""
        if not self.entitled(candidate.tenant, shares):
            return []
        over = {tenant: count - shares[tenant] for tenant, count in self.running.items()
                if count > shares[tenant]}
        order = sorted(over, key=lambda tenant: (-over[tenant], tenant))
        return [r for tenant in order for r in reversed(running) if r.tenant == tenant]
