"""The seed's slot model: S slots, one token per slot per iteration, static or continuous.

A request arrives at an iteration, waits in a FCFS queue, takes a free slot, spends
`prefill_iterations` iterations prefilling (0 in the seed: its first token comes from its
first iteration) and then one iteration per output token. The two policies differ only in
the admission rule, as in the engine:

- static: admit (up to S) only when no request runs; a finished request leaves its slot
  idle until the whole batch is done;
- continuous: every iteration, requests that finished in the previous iteration have left
  and waiting requests take the free slots.

`simulate` returns a trace in the format the engine records (`slotserve.engine.trace.Trace`;
`slotserve.lab.timeline` draws both), so a simulated run and a real one can be compared on
the same chart. The simulator's clock is the iteration.

This is the seed's model, with its own admission code. `slotserve.lab.replay` runs the
engine's real scheduler instead, on a unit clock (the same seed numbers) or on a cost model
calibrated on this machine (`slotserve replay`, `slotserve plan`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from slotserve.engine.trace import TRACE_VERSION
from slotserve.obs.trace import is_busy
from slotserve.value_checks import is_int

POLICIES = ("static", "continuous")


@dataclass(frozen=True)
class SimRequest:
    """One simulated request: arrives at `arrival_iteration`, then needs `output_tokens`
    decode iterations. `prompt_tokens` only sizes the prefill cells (their `tokens`)."""

    id: str
    output_tokens: int
    arrival_iteration: int = 0
    prompt_tokens: int = 0

    def __post_init__(self) -> None:
        _check(isinstance(self.id, str) and self.id != "", "id",
               f"must be a non-empty string, got {self.id!r}")
        _check(is_int(self.output_tokens) and self.output_tokens >= 1, "output_tokens",
               f"must be an integer >= 1, got {self.output_tokens!r} (request {self.id!r})")
        _check(is_int(self.arrival_iteration) and self.arrival_iteration >= 0,
               "arrival_iteration",
               f"must be an integer >= 0, got {self.arrival_iteration!r} (request {self.id!r})")
        _check(is_int(self.prompt_tokens) and self.prompt_tokens >= 0, "prompt_tokens",
               f"must be an integer >= 0, got {self.prompt_tokens!r} (request {self.id!r})")



@dataclass
class _Running:
    """A request holding a slot: how many prefill and decode iterations it still needs."""

    request: SimRequest
    prefill_total: int
    prefill_left: int
    decode_left: int

    @property
    def done(self) -> bool:
        return self.prefill_left == 0 and self.decode_left == 0

    def step(self) -> dict:
        """Spend one iteration; return this slot's cell for the trace."""
        if self.prefill_left:
            chunk = self._prefill_chunk(self.prefill_total - self.prefill_left)
            self.prefill_left -= 1
            return {"request": self.request.id, "kind": "prefill", "tokens": chunk}
        self.decode_left -= 1
        return {"request": self.request.id, "kind": "decode", "tokens": 1}

    def _prefill_chunk(self, i: int) -> int:
        """Prompt tokens processed in prefill iteration i (prompt split evenly over them)."""
        p, k = self.request.prompt_tokens, self.prefill_total
        return p * (i + 1) // k - p * i // k


def simulate(requests: Sequence[SimRequest], num_slots: int, policy: str,
             prefill_iterations: int = 0) -> dict:
    """Run the slot model and return its trace (format in this module's docstring).

    Iterations where nothing runs (before a later arrival) are kept, all slots idle, so an
    iteration's index is the simulated time; the trace ends at the last finish.
    Raises ValueError naming the field on bad input.
    """
    _validate(requests, num_slots, policy, prefill_iterations)
    # NOTE: FCFS by arrival; the stable sort keeps input order among equal arrivals.
    pending = deque(sorted(requests, key=lambda r: r.arrival_iteration))
    records = {r.id: _request_record(r) for r in requests}
    slots: list[_Running | None] = [None] * num_slots
    iterations: list[dict] = []
    unfinished = len(requests)
    while unfinished:
        t = len(iterations)
        if _may_admit(policy, slots):
            _admit(slots, pending, t, records, prefill_iterations)
        cells = [None if run is None else run.step() for run in slots]
        iterations.append(_iteration_record(t, cells, _num_waiting(pending, t)))
        unfinished -= _retire(slots, t, records)
    return {
        "version": TRACE_VERSION,
        "source": "simulator",
        "policy": policy,
        "num_slots": num_slots,
        "kv_blocks_total": None,
        "requests": list(records.values()),
        "iterations": iterations,
    }


def _may_admit(policy: str, slots: list[_Running | None]) -> bool:
    """The one difference between the policies: when waiting requests may take slots."""
    if policy == "static":
        # NOTE: static admits only into an empty batch; nothing joins mid-flight.
        return all(run is None for run in slots)
    return any(run is None for run in slots)


def _admit(slots: list[_Running | None], pending: deque, t: int, records: dict,
           prefill_iterations: int) -> None:
    """Give free slots (lowest index first) to arrived requests, FCFS."""
    for i, run in enumerate(slots):
        if run is None and pending and pending[0].arrival_iteration <= t:
            request = pending.popleft()
            slots[i] = _Running(request, prefill_iterations, prefill_iterations,
                                request.output_tokens)
            records[request.id]["first_iteration"] = t


def _retire(slots: list[_Running | None], t: int, records: dict) -> int:
    """Free the slots of requests that finished in iteration t; return how many."""
    finished = 0
    for i, run in enumerate(slots):
        if run is not None and run.done:
            record = records[run.request.id]
            record["finish_iteration"] = t
            record["finish_reason"] = "length"
            slots[i] = None
            finished += 1
    return finished


def _num_waiting(pending: deque, t: int) -> int:
    """Requests that have arrived by iteration t but hold no slot."""
    count = 0
    for request in pending:  # sorted by arrival
        if request.arrival_iteration > t:
            break
        count += 1
    return count


def _request_record(request: SimRequest) -> dict:
    return {
        "id": request.id,
        "arrival": float(request.arrival_iteration),
        "arrival_iteration": request.arrival_iteration,
        "prompt_tokens": request.prompt_tokens,
        "output_tokens": request.output_tokens,
        "first_iteration": None,
        "finish_iteration": None,
        "finish_reason": None,
    }


def _iteration_record(t: int, cells: list[dict | None], num_waiting: int) -> dict:
    return {
        "index": t,
        "start": float(t),
        "end": float(t + 1),
        "slots": cells,
        "num_waiting": num_waiting,
        "kv_blocks_used": None,
        "preempted": [],
    }


def summarize(trace: dict) -> dict:
    """Iterations, utilisation and per-request wait/first/finish of a trace (any source).

    utilisation = busy slot-iterations / (num_slots x iterations); 0.0 for an empty trace.
    wait_iterations = first_iteration - arrival_iteration (None if never scheduled).
    """
    iterations = trace["iterations"]
    busy = sum(is_busy(cell) for it in iterations for cell in it["slots"])
    capacity = trace["num_slots"] * len(iterations)
    return {
        "iterations": len(iterations),
        "busy_slot_iterations": busy,
        "slot_iterations": capacity,
        "utilisation": busy / capacity if capacity else 0.0,
        "requests": [_request_summary(r) for r in trace["requests"]],
    }


def _request_summary(record: dict) -> dict:
    first = record.get("first_iteration")
    arrival = record.get("arrival_iteration")
    wait = None if first is None or arrival is None else first - arrival
    return {
        "id": record["id"],
        "arrival_iteration": arrival,
        "wait_iterations": wait,
        "first_iteration": first,
        "finish_iteration": record.get("finish_iteration"),
    }


def _validate(requests: Sequence[SimRequest], num_slots: int, policy: str,
              prefill_iterations: int) -> None:
    _check(is_int(num_slots) and num_slots >= 1, "num_slots",
           f"must be an integer >= 1, got {num_slots!r}")
    _check(policy in POLICIES, "policy", f"must be one of {POLICIES}, got {policy!r}")
    _check(is_int(prefill_iterations) and prefill_iterations >= 0, "prefill_iterations",
           f"must be an integer >= 0, got {prefill_iterations!r}")
    _check(all(isinstance(r, SimRequest) for r in requests), "requests",
           "must be SimRequest objects")
    ids = [r.id for r in requests]
    _check(len(set(ids)) == len(ids), "id", "request ids must be unique")


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name} {message}")


# The seed's toy: 6 requests on 3 slots; R2 is the long generation.
SEED_TOY: list[SimRequest] = [
    SimRequest(f"R{i}", n) for i, n in enumerate((2, 8, 3, 4, 3, 2), start=1)
]
