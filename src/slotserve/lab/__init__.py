"""The lab: the seed's slot simulator and the charts that draw its traces and the engine's.

`simulate` (the seed's model) and `timeline` (slot strips: terminal, HTML, PNG) share one
trace format with the engine, so a simulated run and a real one read the same way.
`commands` holds the `slotserve simulate` / `slotserve timeline` subcommands.
"""

from slotserve.lab.simulate import SEED_TOY, SimRequest, simulate, summarize

__all__ = ["SEED_TOY", "SimRequest", "simulate", "summarize"]
