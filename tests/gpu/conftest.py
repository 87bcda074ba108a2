"""tests/gpu: the Triton kernels (slotserve.gpu.triton_ops) against their torch references.

Where CUDA is available the kernels are compiled and the tests run on the GPU
(benchmarks/gpu_check.py); elsewhere, CI included, Triton's interpreter runs the same tests
on CPU tensors. NOTE: TRITON_INTERPRET=1 is set here, before any test module imports
triton_ops: Triton reads it when a kernel is decorated and again in modules it imports
lazily while launching, so it stays set for the session (nothing else in slotserve uses
Triton).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def device() -> torch.device:
    """Where the kernels run: CPU tensors in the interpreter, else the GPU."""
    ops = pytest.importorskip("slotserve.gpu.triton_ops")
    return torch.device("cpu" if ops.INTERPRETED else "cuda")
