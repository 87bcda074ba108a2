"""Replay: the real scheduler on a calibrated clock, to predict a run before it happens.

One scheduler, two clocks: `replay` drives the core `Scheduler` and `KVCacheManager` (no
torch) with a `FakeRunner` that computes nothing and moves a virtual clock by a cost model's
time for each iteration (`cost_model`: `UnitCost`, the seed's toy clock, or `LinearCost`,
fit per machine by `calibrate`). `inputs` turns a real run's trace or a bench workload into
replayable requests; `plan` searches settings and request rates for the best goodput under
latency SLOs. CLI: `slotserve simulate --trace`, `slotserve calibrate`, `slotserve plan`.
"""

from slotserve.lab.replay.cost_model import (
    FEATURES,
    LinearCost,
    StepFeatures,
    UnitCost,
    load_profile,
    profile_from_dict,
)
from slotserve.lab.replay.inputs import (
    load_input,
    requests_from_trace,
    requests_from_workload,
    scale_rate,
    with_poisson,
)
from slotserve.lab.replay.runner import FakeRunner, VirtualClock, VirtualEngineCore
from slotserve.lab.replay.simulator import (
    ReplayRequest,
    ReplayResult,
    ReplaySettings,
    replay,
    scheduler_request,
)

__all__ = ["FEATURES", "FakeRunner", "LinearCost", "ReplayRequest", "ReplayResult",
           "ReplaySettings", "StepFeatures", "UnitCost", "VirtualClock", "VirtualEngineCore",
           "load_input",
           "load_profile", "profile_from_dict", "replay", "requests_from_trace",
           "requests_from_workload", "scale_rate", "scheduler_request", "with_poisson"]
