"""Fault isolation: retry a failed `runner.execute` in halves to find the culprits.

Also what counts as a fault (`is_fault`): every exception, and the BaseExceptions that
native libraries raise, but never a request to stop the process or a task.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace

from slotserve.core.outputs import RunnerOutput, ScheduledSeq, SchedulerOutput

logger = logging.getLogger("slotserve.engine")

Culprits = list[tuple[ScheduledSeq, BaseException]]

# NOTE: these ask the process (or a task, a generator) to stop; every other BaseException is
# a fault. A Rust panic in a native library (llguidance, tokenizers) reaches Python as
# pyo3's PanicException, a BaseException: caught only as a fault, it fails its request
# instead of the engine loop. (Each pyo3 library has its own PanicException class, so no
# single class names them.)
NOT_FAULTS = (KeyboardInterrupt, SystemExit, GeneratorExit, asyncio.CancelledError)


def is_fault(exc: BaseException) -> bool:
    """An exception that fault isolation handles (not one that stops the process or a task).

    Use as `except BaseException as exc: if not is_fault(exc): raise`.
    """
    return not isinstance(exc, NOT_FAULTS)


def execute_isolated(runner, plan: SchedulerOutput) -> tuple[RunnerOutput, Culprits]:
    """runner.execute(plan); if it raises, find the requests that cause it by bisection.

    Returns the tokens of the requests that ran and the culprits with their exception.
    A fault is any exception `is_fault` accepts (a native library's panic included).

    NOTE: retrying is sound because a failed execute changes nothing the retry depends
    on: num_computed_tokens only moves in scheduler.update, each ScheduledSeq keeps its
    positions and block table, so a retry rewrites the same K/V into the same slots
    (each sequence attends only to its own blocks), and a seeded request's sampler draws
    from a generator seeded by (seed, output index). Unseeded random requests draw
    from the runner's shared generator, which a failed attempt may have advanced.
    """
    try:
        return runner.execute(plan), []
    except BaseException as exc:
        if not is_fault(exc):
            raise
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
        except BaseException as exc:
            if not is_fault(exc):
                raise
            if len(half) == 1:
                culprits.append((half[0], exc))
            else:
                _bisect(runner, plan, half, merged, culprits)
            continue
        merged.merge(result)  # NOTE: with speculative decoding's accepted drafts
