"""Admission rules: when waiting requests may join the running batch."""

from __future__ import annotations

from slotserve.config import Policy


def may_admit(policy: Policy | str, num_running_at_step_start: int) -> bool:
    """Whether this iteration may admit waiting requests at all.

    continuous: every iteration (Orca's iteration-level scheduling).
    static: only when no request runs; the batch then runs until all of it finishes.
    """
    if policy == Policy.CONTINUOUS:
        return True
    if policy == Policy.STATIC:
        return num_running_at_step_start == 0
    raise ValueError(f"unknown policy {policy!r}")


def admission_needs_tokens(policy: Policy | str) -> bool:
    """Whether a request must get a share of this iteration's token budget to be admitted.

    NOTE: static fills the whole batch at once (up to max_num_seqs) even when the budget
    runs out; admitted requests then wait in their slot for budget ("stalled").
    """
    return policy == Policy.CONTINUOUS
