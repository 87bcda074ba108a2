"""The fake runner: computes nothing, samples a fixed non-EOS token, advances a virtual clock.

It stands where the engine's ModelRunner stands (`execute(plan) -> RunnerOutput`), so the
real scheduler sees what it sees in a real run: one token per sampling sequence. Output
lengths come from the requests' `max_tokens` (the recorded length) with `ignore_eos`, so a
request ends exactly where it ended in the run being replayed.
"""

from __future__ import annotations

from slotserve.core.outputs import RunnerOutput, SchedulerOutput
from slotserve.lab.replay.cost_model import StepFeatures

FILLER_TOKEN = 3  # what the fake runner "samples" (never an EOS: requests ignore EOS anyway)


class VirtualClock:
    """Simulated seconds since the start of the run; only `advance` moves it."""

    def __init__(self) -> None:
        self.now = 0.0

    def advance(self, seconds: float) -> float:
        if not seconds >= 0:
            raise ValueError(f"seconds must be >= 0, got {seconds!r}")
        self.now += seconds
        return self.now

    def advance_to(self, t: float) -> float:
        self.now = max(self.now, t)
        return self.now


class FakeRunner:
    """`execute(plan)`: one FILLER_TOKEN per sampling sequence, the clock moved by the cost
    model's time for the plan. `last_start` / `last_end` bound the last iteration."""

    def __init__(self, cost_model, clock: VirtualClock | None = None) -> None:
        self.cost_model = cost_model
        self.clock = clock or VirtualClock()
        self.last_start = self.last_end = self.clock.now
        self.busy_seconds = 0.0

    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        seconds = self.cost_model.step_seconds(StepFeatures.of(plan))
        self.last_start = self.clock.now
        self.last_end = self.clock.advance(seconds)
        self.busy_seconds += seconds
        return RunnerOutput(sampled={seq.request_id: FILLER_TOKEN
                                     for seq in plan.seqs if seq.sample})
