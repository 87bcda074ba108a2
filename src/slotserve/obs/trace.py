"""Helpers over the trace format (version 1, described in `slotserve.lab.simulate`).

The engine records its own trace (`slotserve.engine.trace`, for `--trace` export and
/debug/trace); the layers above it receive each iteration's record in an `IterationEvent`.
"""

from __future__ import annotations


def is_busy(cell: dict | None) -> bool:
    """A slot-iteration doing work: occupied and not stalled (the seed's utilisation)."""
    return cell is not None and cell["kind"] != "stalled"
