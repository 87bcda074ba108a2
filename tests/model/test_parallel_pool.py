"""The kernels' thread pool (csrc/parallel.h's parallel_for on the pool; every range on it here).

Its promises: every index of a range runs exactly once, whatever the range, grain and thread
count; a call returns when every chunk is done, not when every worker has arrived (a worker
held back by a busy neighbour's core costs nothing: checked by pausing the workers, not by
timing); two Python threads may call at once, and a call from inside a chunk runs inline;
an exception in a chunk reaches the caller; and a kernel's bits do not depend on the thread
count (tests/model/test_kernels_gil.py's kernels, compared between 1, 2 and 3 threads).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.model.test_kernels_gil import _inputs, kernels

SIZES = (0, 1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 64, 100, 1000, 4097)
GRAINS = (1, 2, 3, 16, 1000)


@pytest.fixture(autouse=True)
def pool_on(cpu_ops, monkeypatch):
    """Every range of parallel_for on the pool for the test (by default only the decode
    stack's and those beside busy processes are: parallel.h's NOTE), restored after."""
    before = cpu_ops.thread_pool_on()
    monkeypatch.setenv("SLOTSERVE_THREAD_POOL", "1")
    cpu_ops.set_thread_pool(True)
    yield
    monkeypatch.undo()
    cpu_ops.set_thread_pool(before)


def test_the_pool_is_on_by_default():
    """A fresh process has the pool on unless SLOTSERVE_THREAD_POOL=0; set_thread_pool(True)
    with the variable at 1 runs a range outside any SpinScope on the pool's workers."""
    probe = ("import os; from slotserve.model.cpu_ops import load_cpu_ops as l; o = l(); "
             "print(o.thread_pool_on()); os.environ['SLOTSERVE_THREAD_POOL'] = '1'; "
             "o.set_thread_pool(True); b = o.pool_worker_chunks(); "
             "[o.pool_cover(200_000, 1) for _ in range(200)]; print(o.pool_worker_chunks() > b)")
    base = {k: v for k, v in os.environ.items() if k != "SLOTSERVE_THREAD_POOL"}
    for extra, expected in (({}, "True"), ({"SLOTSERVE_THREAD_POOL": "1"}, "True"),
                            ({"SLOTSERVE_THREAD_POOL": "0"}, "False")):
        run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                             env={**base, **extra}, timeout=300)
        assert run.stdout.strip().splitlines()[-2:] == [expected, "True"], run.stderr[-2000:]


def test_beside_a_busy_process_ranges_outside_the_stack_run_on_the_pool(cpu_ops, threads,
                                                                       monkeypatch):
    """The default (the pool on, no variable): outside any SpinScope a range runs on the pool
    while another process takes CPU time (a spinning one here), so its workers run chunks.
    (The quiet case, at::parallel_for, is not checked: this machine is shared.)"""
    threads(2)
    monkeypatch.delenv("SLOTSERVE_THREAD_POOL")
    cpu_ops.set_thread_pool(True)
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        before = cpu_ops.pool_worker_chunks()
        deadline = time.monotonic() + 30
        while cpu_ops.pool_worker_chunks() == before and time.monotonic() < deadline:
            assert torch.equal(cpu_ops.pool_cover(200_000, 1), ones(200_000))
    finally:
        spinner.kill()
        spinner.wait()
    assert cpu_ops.pool_worker_chunks() > before


@pytest.fixture
def threads():
    """Sets torch's (and so the pool's) thread count for the test, restored after."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.fixture
def paused_workers(cpu_ops):
    """The pool's workers wait before claiming any chunk (until the test ends)."""
    cpu_ops.set_pool_workers_paused(True)
    yield
    cpu_ops.set_pool_workers_paused(False)


def ones(n: int) -> torch.Tensor:
    return torch.ones(n, dtype=torch.int32)


@pytest.mark.parametrize("thread_count", [1, 2, 3])
def test_every_index_runs_exactly_once(cpu_ops, threads, thread_count):
    threads(thread_count)
    assert cpu_ops.pool_threads() == thread_count
    for n in SIZES:
        for grain in GRAINS:
            for nested in (False, True):
                assert torch.equal(cpu_ops.pool_cover(n, grain, nested), ones(n)), (
                    n, grain, nested)


def test_the_caller_finishes_alone_when_the_workers_do_not_come(cpu_ops, threads,
                                                                 paused_workers):
    """The workers paused (as if their cores were busy elsewhere): every call still returns,
    complete, every chunk run by the caller."""
    threads(2)
    weight = torch.randn(100, 64, generator=torch.Generator().manual_seed(0))
    panels = cpu_ops.pack_panels(weight)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    before = cpu_ops.pool_worker_chunks()
    results: dict[str, object] = {}

    def calls() -> None:
        results["cover"] = [torch.equal(cpu_ops.pool_cover(n, 1), ones(n)) for n in SIZES]
        results["linear"] = cpu_ops.panel_linear(x, panels, 100)

    # NOTE: in a thread, so that a caller waiting for its workers fails the test (a call
    # stuck for a minute) instead of hanging it; the fixture's unpausing then releases it
    caller = threading.Thread(target=calls, daemon=True)
    caller.start()
    caller.join(timeout=60)
    assert not caller.is_alive(), "the caller waited for the paused workers"
    assert results["cover"] == [True] * len(SIZES)
    torch.testing.assert_close(results["linear"], x @ weight.T, rtol=1e-5, atol=1e-5)
    assert cpu_ops.pool_worker_chunks() == before


def test_workers_resume_after_a_pause(cpu_ops, threads):
    """A worker that wakes after its job finished finds nothing to run, and later jobs use
    it again (their chunks partly run by it, which the paused test shows it did not)."""
    threads(2)
    cpu_ops.set_pool_workers_paused(True)
    try:
        assert torch.equal(cpu_ops.pool_cover(1000, 1), ones(1000))
    finally:
        cpu_ops.set_pool_workers_paused(False)
    before = cpu_ops.pool_worker_chunks()
    deadline = time.monotonic() + 30
    while cpu_ops.pool_worker_chunks() == before and time.monotonic() < deadline:
        assert torch.equal(cpu_ops.pool_cover(200_000, 1), ones(200_000))
    assert cpu_ops.pool_worker_chunks() > before


def test_two_python_threads_at_once(cpu_ops, threads):
    """Two threads call at once, many times (one holds the pool, the other runs inline, or
    both take turns): every call covers its range exactly once."""
    threads(2)
    failures: list[tuple[int, int]] = []
    barrier = threading.Barrier(2)

    def run(t: int) -> None:
        barrier.wait()
        for i in range(200):
            n = 1 + (37 * i + t) % 3000
            if not torch.equal(cpu_ops.pool_cover(n, 1 + i % 3, i % 2 == 1), ones(n)):
                failures.append((t, i))

    workers = [threading.Thread(target=run, args=(t,)) for t in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert failures == []


def test_an_exception_in_a_chunk_reaches_the_caller(cpu_ops, threads):
    """The chunk's error, on the caller, once every chunk has finished; the pool then runs
    the next call whole."""
    threads(2)
    for nested in (False, True):
        with pytest.raises(RuntimeError, match="index 777"):
            cpu_ops.pool_cover(1000, 1, nested, throw_at=777)
        assert torch.equal(cpu_ops.pool_cover(1000, 1, nested), ones(1000))


def test_kernel_bits_do_not_depend_on_the_thread_count(cpu_ops, threads):
    """Every GIL-test kernel on batches of 1 to 70 rows: the same bits on 1, 2 and 3
    threads (and with the workers paused: the caller alone, cut in chunks for 2)."""
    inputs = [_inputs(rows, seed=rows) for rows in (1, 3, 16, 33, 70)]
    threads(1)
    found = kernels(cpu_ops)
    expected = {name: [kernel(x) for x in inputs] for name, kernel in found.items()}
    for thread_count, paused in ((2, False), (3, False), (2, True)):
        threads(thread_count)
        cpu_ops.set_pool_workers_paused(paused)
        try:
            for name, kernel in found.items():
                for x, want in zip(inputs, expected[name], strict=True):
                    assert torch.equal(kernel(x), want), (name, thread_count, paused, len(x))
        finally:
            cpu_ops.set_pool_workers_paused(False)


def _stress(cpu_ops, *args: str, timeout: float) -> str:
    """tests/model/pool_stress.py in a child process; its output (a hang fails by timeout)."""
    root = Path(__file__).resolve().parents[2]
    try:
        done = subprocess.run([sys.executable, "-m", "tests.model.pool_stress", *args], cwd=root,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"pool_stress {args} hung (over {timeout} s)")
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_a_worker_late_on_a_finished_job_claims_nothing_of_the_next(cpu_ops):
    """The race that once hung the full suite, its windows widened (a worker descheduled
    between the claim word and the job's fields, a caller between writing a job and
    publishing it): without the close (parallel.cpp's NOTE), the worker claimed a chunk of
    the next, unpublished job, which ran twice and counted one too many, and the caller
    slept for ever; here every call covers its range once, and returns."""
    assert "ok " in _stress(cpu_ops, "race", "300", timeout=60)


def test_everything_at_once(cpu_ops):
    """Two calling threads, nested calls, exceptions, thread-count changes, pauses, the race
    hooks and forks, for a few seconds: no hang, every range covered once."""
    assert "ok " in _stress(cpu_ops, "mixed", "3", "0", timeout=60)
