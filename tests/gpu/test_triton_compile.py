"""Every Triton kernel compiles for the H200 (sm_90) on a machine without a GPU: Triton's
front end, LLVM and its bundled ptxas (slotserve.gpu.aot), in a subprocess, since this
session's kernels may be the interpreter's (which cannot be compiled)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

KERNELS = {"_write_kv_kernel", "_decode_attention_kernel", "_decode_reduce_kernel",
           "_rms_norm_kernel", "_rotary_kernel", "_silu_mul_kernel"}


@pytest.mark.slow  # ~10 s: 20 variants through LLVM and ptxas
def test_every_kernel_compiles_for_sm90_without_a_gpu():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "slotserve.gpu.aot", "--arch", "90"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    compiled = [json.loads(line) for line in done.stdout.splitlines()]
    assert {c["kernel"] for c in compiled} == KERNELS
    assert {c["variant"].split("-")[0] for c in compiled} == {"fp32", "bf16"}
    assert all(c["registers"] for c in compiled), compiled  # ptxas -v was read
