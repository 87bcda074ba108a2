"""The runner's heap settings (runner/heap.py): memory a step frees is not given back to the
kernel and faulted in again by the next step.

Each case runs in a fresh interpreter (the heap's state is the process's): a 12 MB tensor
freed first (glibc's mmap threshold then follows it up), then STEPS_RUN "steps" of three 12 MB
tensors written and freed (36 MB: 9216 pages). Without the settings glibc gives memory at
the heap's top back after a step and the next faults it in again (here 1557 pages a step
with torch's huge-page allocations, up to 9216 without); with them only the first step
faults, but for a rare 2 MB (519 pages) that the kernel's huge-page handling takes back.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from slotserve.runner.heap import _glibc

pytestmark = pytest.mark.skipif(_glibc() is None, reason="the C library is not glibc")

STEPS_SCRIPT = """
import resource, sys, torch
if sys.argv[1] == "keep":
    from slotserve.runner.heap import keep_freed_memory
    assert keep_freed_memory()
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
first = torch.empty(3 << 20)
first.fill_(1)
del first
counts = []
for _ in range(int(sys.argv[2])):
    before = faults()
    blocks = [torch.empty(3 << 20) for _ in range(3)]  # (3M,) fp32: 12 MB each
    for block in blocks:
        block.fill_(1)
    del blocks, block
    counts.append(faults() - before)
print(*counts)
"""
PAGES_OF_ONE_STEP = 3 * (12 << 20) // 4096
STEPS_RUN = 8


def _faults_per_step(mode: str) -> list[int]:
    out = subprocess.run([sys.executable, "-c", STEPS_SCRIPT, mode, str(STEPS_RUN)],
                         capture_output=True, text=True, check=True, timeout=120).stdout
    return [int(n) for n in out.split()]


def test_without_the_settings_later_steps_fault_their_memory_in_again():
    counts = _faults_per_step("plain")
    assert sum(counts[1:]) > PAGES_OF_ONE_STEP, counts


def test_with_them_later_steps_reuse_the_first_step_s_memory():
    counts = _faults_per_step("keep")
    assert counts[0] > 0 and sum(counts[1:]) < PAGES_OF_ONE_STEP // 4, counts
