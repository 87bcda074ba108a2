"""Fault isolation: retry a failed `runner.execute` in halves to find the culprits."""

from __future__ import annotations

import logging
from dataclasses import replace

from slotserve.core.outputs import RunnerOutput, ScheduledSeq, SchedulerOutput

logger = logging.getLogger("slotserve.engine")

Culprits = list[tuple[ScheduledSeq, Exception]]


def execute_isolated(runner, plan: SchedulerOutput) -> tuple[RunnerOutput, Culprits]:
    """runner.execute(plan); if it raises, find the requests that cause it by bisection.

    Returns the tokens of the requests that ran and the culprits with their exception.

    NOTE: retrying is sound because a failed execute changes nothing the retry depends
    on: num_computed_tokens only moves in scheduler.update, each ScheduledSeq keeps its
    positions and block table, so a retry rewrites the same K/V into the same slots
    (each sequence attends only to its own blocks), and a seeded request's sampler draws
    from a generator seeded by (seed, output index). Unseeded random requests draw
    from the runner's shared generator, which a failed attempt may have advanced.
    """
    try:
        return runner.execute(plan), []
    except Exception as exc:
        if len(plan.seqs) == 1:
            return RunnerOutput(sampled={}), [(plan.seqs[0], exc)]
        logger.warning("iteration %d failed (%s: %s); retrying its %d requests in smaller "
                       "groups", plan.iteration, type(exc).__name__, exc, len(plan.seqs))
    merged = RunnerOutput(sampled={}, logprobs={})
    culprits: Culprits = []
    _bisect(runner, plan, plan.seqs, merged, culprits)
    return merged, culprits


def _bisect(runner, plan: SchedulerOutput, seqs: list[ScheduledSeq], merged: RunnerOutput,
            culprits: Culprits) -> None:
    """Run seqs' two halves separately; split again any half that raises."""
    middle = len(seqs) // 2
    for half in (seqs[:middle], seqs[middle:]):
        try:
            result = runner.execute(replace(plan, seqs=half))
        except Exception as exc:
            if len(half) == 1:
                culprits.append((half[0], exc))
            else:
                _bisect(runner, plan, half, merged, culprits)
            continue
        merged.sampled.update(result.sampled)
        merged.logprobs.update(result.logprobs)
