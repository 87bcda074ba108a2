"""Stress for the kernels' thread pool (csrc/parallel.cpp), run in a child process so that a
hang fails a test (by its timeout) instead of hanging it: `python -m tests.model.pool_stress`.

race ROUNDS: the windows of the race that once hung the full suite, widened by test hooks (a
worker sleeps between reading the claim word and the job it names, the caller between writing
a job and publishing it), across jobs of few chunks then more.
mixed SECONDS: two Python threads calling at once, nested calls, exceptions in chunks, thread
counts changed between calls (a resize of the pool), the workers paused and resumed, the race
hooks switched on and off, forks whose child runs jobs on a pool of its own, and the mode
switched (OpenMP, the pool everywhere, the default) while calls run.
Prints one line `ok <counts>` when every call covered its range exactly once.
"""

from __future__ import annotations

import os
import random
import sys
import threading
import time

import torch

from slotserve.model.cpu_ops import load_cpu_ops


def covered(ops, n: int, grain: int, nested: bool = False) -> bool:
    """Whether parallel_for(0, n, grain) ran every index exactly once."""
    return torch.equal(ops.pool_cover(n, grain, nested), torch.ones(n, dtype=torch.int32))


def race(ops, rounds: int) -> dict[str, int]:
    """A worker that read a finished job's word must not claim a chunk of the next job."""
    torch.set_num_threads(2)
    ops.set_pool_race_delays(50, 300)
    try:
        bad = sum(not covered(ops, n, 1) for _ in range(rounds) for n in (4, 64))
    finally:
        ops.set_pool_race_delays(0, 0)
    return {"jobs": 2 * rounds, "bad": bad}


def _caller(ops, seed: int, stop: threading.Event, counts: dict[str, int]) -> None:
    rng = random.Random(seed)
    while not stop.is_set():
        if rng.random() < 0.02:
            torch.set_num_threads(rng.choice((1, 2, 3)))
            counts["resizes"] += 1
        n, grain = rng.choice((1, 7, 64, 300, 5000)), rng.choice((1, 2, 16))
        nested = rng.random() < 0.2
        if rng.random() < 0.05:
            try:
                ops.pool_cover(n, grain, nested, throw_at=n - 1)
                counts["bad"] += 1  # the chunk's exception must reach the caller
            except RuntimeError:
                counts["raised"] += 1
            continue
        counts["calls"] += 1
        counts["bad"] += not covered(ops, n, grain, nested)


def _fork(ops) -> bool:
    """A child forked mid-stress runs jobs on a pool of its own and exits; False if it failed
    or hung (10 s)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            torch.set_num_threads(2)
            code = 0 if all(covered(ops, 1000, 1) for _ in range(20)) else 1
        finally:
            os._exit(code)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status) == 0
        time.sleep(0.005)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return False


def _set_mode(ops, variable: str | None) -> None:
    """SLOTSERVE_THREAD_POOL=variable (None: unset, the default), then set_thread_pool: 0 every
    range on OpenMP, 1 every range on the pool, unset the pool while others busy the CPUs."""
    if variable is None:
        os.environ.pop("SLOTSERVE_THREAD_POOL", None)
    else:
        os.environ["SLOTSERVE_THREAD_POOL"] = variable
    ops.set_thread_pool(variable != "0")


def mixed(ops, seconds: float, seed: int = 0) -> dict[str, int]:
    """Everything at once for `seconds` (see the module's docstring)."""
    rng = random.Random(seed)
    keys = ("calls", "raised", "resizes", "pauses", "forks", "modes", "bad")
    counts = dict.fromkeys(keys, 0)
    own = [dict.fromkeys(keys, 0) for _ in range(2)]  # each caller's
    stop = threading.Event()
    callers = [threading.Thread(target=_caller, args=(ops, seed + t, stop, own[t]))
               for t in range(2)]
    for caller in callers:
        caller.start()
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            time.sleep(rng.uniform(0, 0.02))
            action = rng.random()
            if action < 0.3:
                ops.set_pool_workers_paused(True)
                time.sleep(rng.uniform(0, 0.002))
                ops.set_pool_workers_paused(False)
                counts["pauses"] += 1
            elif action < 0.6:
                ops.set_pool_race_delays(*rng.choice(((0, 0), (0, 20), (20, 0), (5, 60))))
            elif action < 0.65:
                counts["forks"] += 1
                counts["bad"] += not _fork(ops)
            elif action < 0.75:
                _set_mode(ops, rng.choice(("0", "1", None)))
                counts["modes"] += 1
    finally:
        stop.set()
        for caller in callers:
            caller.join()
        ops.set_pool_race_delays(0, 0)
        ops.set_pool_workers_paused(False)
        _set_mode(ops, "1")
    return {k: counts[k] + sum(c[k] for c in own) for k in keys}


def main(argv: list[str]) -> int:
    ops = load_cpu_ops()
    if ops is None:
        print("no kernels")
        return 2
    _set_mode(ops, "1")  # every range on the pool (parallel.h's NOTE); mixed switches too
    mode, amount = argv[0], float(argv[1])
    counts = race(ops, int(amount)) if mode == "race" else mixed(ops, amount, int(argv[2]))
    print(("ok " if counts["bad"] == 0 else "BAD ") + repr(counts), flush=True)
    return 0 if counts["bad"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
