"""The fake runner: computes nothing, samples a fixed non-EOS token, advances a virtual clock.

It stands where the engine's ModelRunner stands (`execute(plan) -> RunnerOutput`), so the
real scheduler sees what it sees in a real run: one token per sampling sequence. Output
lengths come from the requests' `max_tokens` (the recorded length) with `ignore_eos`, so a
request ends exactly where it ended in the run being replayed.
"""

from __future__ import annotations

from slotserve.config import CacheConfig, SchedulerConfig
from slotserve.core.kv_manager import KVCacheManager, cdiv
from slotserve.core.outputs import RunnerOutput, SchedulerOutput
from slotserve.core.scheduler import Scheduler
from slotserve.lab.replay.cost_model import StepFeatures
from slotserve.request import Request

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

    def __init__(self, cost_model, clock: VirtualClock | None = None,
                 acceptance=None) -> None:
        """acceptance: how many drafts a verification accepts (`accepted(seq_id,
        output position, k)`, speculation.DraftOracle); None: none are."""
        self.cost_model = cost_model
        self.clock = clock or VirtualClock()
        self.acceptance = acceptance
        self.last_start = self.last_end = self.clock.now
        self.busy_seconds = 0.0
        self.forwards = 0

    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        features = StepFeatures.of(plan, first_forward=self.forwards == 0)
        seconds = self.cost_model.step_seconds(features)
        self.forwards += 1
        self.last_start = self.clock.now
        self.last_end = self.clock.advance(seconds)
        self.busy_seconds += seconds
        output = RunnerOutput(sampled={seq.request_id: FILLER_TOKEN
                                       for seq in plan.seqs if seq.sample})
        for seq in plan.seqs:
            if seq.spec_token_ids:
                drafts = seq.spec_token_ids
                num = 0 if self.acceptance is None else self.acceptance.accepted(
                    seq.request_id, seq.num_output_tokens, len(drafts))
                output.accepted[seq.request_id] = list(drafts[:num])
        return output


def default_num_blocks(max_num_seqs: int, max_model_len: int, block_size: int) -> int:
    """The engine's KV pool when memory is plentiful: every slot can hold a max_model_len
    sequence."""
    return max_num_seqs * cdiv(max_model_len, block_size)


class VirtualEngineCore:
    """The real `Scheduler` and `KVCacheManager` of a config, run by a `FakeRunner` on one
    `VirtualClock`: the piece the replay simulator and benchmarks/policies.py's SimEngine
    share.

    cache.num_blocks None: `default_num_blocks`.
    sliding_window: the model's one window on every layer (as the engine's KVCacheManager:
    the blocks before each request's window are freed); None: every block is kept.
    speculator: the scheduler's (spec/planner.Speculator; None: no speculation);
    acceptance: the fake runner's (see `FakeRunner`).
    """

    def __init__(self, scheduler_config: SchedulerConfig, cache: CacheConfig,
                 cost_model, speculator=None, acceptance=None,
                 sliding_window: int | None = None) -> None:
        blocks = cache.num_blocks or default_num_blocks(
            scheduler_config.max_num_seqs, scheduler_config.max_model_len, cache.block_size)
        self.clock = VirtualClock()
        # NOTE: the engine's block hashes (tenant-scoped or global) for the same requests.
        self.kv = KVCacheManager(blocks, cache.block_size, cache.enable_prefix_caching,
                                 tenant_scoped=cache.tenant_scoped,
                                 sliding_window=sliding_window)
        # NOTE: the scheduler reads the virtual clock, never the wall clock: request times,
        # SLO deadlines and slack, fair-share and the deadline policy's learnt iteration time
        # are all in simulated seconds, the clock of the requests' (virtual) arrival times.
        self.scheduler = Scheduler(scheduler_config, self.kv, clock=self.now,
                                   speculator=speculator)
        self.runner = FakeRunner(cost_model, self.clock, acceptance)

    def now(self) -> float:
        return self.clock.now

    def step(self) -> tuple[SchedulerOutput, list[Request]]:
        """Plan one iteration, "execute" it (the clock moves by its modelled time), apply it:
        (the plan, the requests it updated). An empty plan executes nothing."""
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return plan, []
        result = self.runner.execute(plan)
        return plan, self.scheduler.update(plan, result)
