"""The Triton prefill attention compiles for the H200 (sm_90) on a machine without a GPU
(slotserve.gpu.aot: Triton's front end, LLVM and its bundled ptxas), at the variants its
launcher makes for Llama-3's head shapes, and its default tiles spill no registers. In a
subprocess: this session's kernels may be the interpreter's, which cannot be compiled."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

# Each variant: (name, dtype, head dim, windowed, block_m, block_n or None for the default)
VARIANTS = [
    ("bf16-hd128", "bfloat16", 128, False, 128, None),
    ("bf16-hd128-window", "bfloat16", 128, True, 128, None),
    ("bf16-hd64", "bfloat16", 64, False, 128, None),
    ("fp16-hd128", "float16", 128, False, 128, None),
    ("fp32-hd64", "float32", 64, False, 128, None),
    ("bf16-hd128-m64-n32", "bfloat16", 128, False, 64, 32),
]

COMPILE = """
import json, sys, torch
from slotserve.gpu import aot, triton_prefill as tp
for name, dtype, hd, windowed, block_m, block_n in json.loads(sys.argv[1]):
    dtype = getattr(torch, dtype)
    x = torch.empty(2, 4096, dtype=dtype)
    cache = torch.empty(4, 16, 8, hd, dtype=dtype)
    ints = torch.empty(2, 4, dtype=torch.int64)
    args = dict(q_ptr=x, k_cache_ptr=cache, v_cache_ptr=cache, tables_ptr=ints, seqs_ptr=ints,
                tiles_ptr=ints, out_ptr=x, scale=0.1, window=4096, stride_qt=6144,
                stride_qh=hd, stride_ot=4096, stride_oh=hd, stride_cb=16 * 8 * hd,
                stride_cp=8 * hd, stride_ch=hd, stride_ts=64)
    constexprs = dict(GROUP=4, GROUP_P=4, HD=hd, HD_P=hd, BLOCK_SIZE=16,
                      BLOCK_Q=tp.tokens_per_tile(4, block_m),
                      BLOCK_N=block_n or tp.default_block_n(hd), WINDOWED=windowed,
                      IEEE=dtype == torch.float32)
    compiled = aot.compile_kernel(tp._prefill_attention_kernel, args, constexprs, 90,
                                  8 if block_m >= 128 else 4)
    registers, spills = aot.ptxas_report(compiled.asm["ptx"], 90)
    print(json.dumps(dict(variant=name, registers=registers, spill_bytes=spills,
                          wgmma="wgmma" in compiled.asm["ptx"])), flush=True)
"""


@pytest.mark.slow  # ~15 s: 6 variants through LLVM and ptxas
def test_the_prefill_kernel_compiles_for_sm90_without_a_gpu():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", COMPILE, json.dumps(VARIANTS)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    compiled = {c["variant"]: c for c in map(json.loads, done.stdout.splitlines())}
    assert set(compiled) == {v[0] for v in VARIANTS}
    assert all(c["registers"] for c in compiled.values()), compiled  # ptxas -v was read
    # the 16-bit variants run on Hopper's tensor cores (wgmma), without spills at the
    # default tiles
    for name in ("bf16-hd128", "bf16-hd128-window", "bf16-hd64", "fp16-hd128"):
        assert compiled[name]["wgmma"], name
        assert compiled[name]["spill_bytes"] == 0, compiled[name]
