"""Compile every Triton kernel of triton_ops for a CUDA GPU without one (ahead of time).

Triton's front end, LLVM and its bundled ptxas need no GPU, so a machine without one (CI)
can check that the kernels compile for the H200 (sm_90) and read ptxas's resource report
(registers, spills) before any device time is spent. Each kernel is compiled at the
variants the launchers use (fp32 and bf16, one split and several, with a window or not).

Run: `python -m slotserve.gpu.aot [--arch 90]` (TRITON_INTERPRET must be unset: the
interpreter's kernels cannot be compiled). Prints one JSON line per variant.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import mangle_type

from slotserve.gpu import triton_ops as ops


@dataclass(frozen=True)
class Compiled:
    kernel: str
    variant: str
    seconds: float
    registers: int | None  # per thread, from ptxas -v (None if it could not be read)
    spill_bytes: int | None  # spill stores + loads


def compile_kernel(kernel, args: dict, constexprs: dict, arch: int, num_warps: int = 4):
    """Compile `kernel` for sm_`arch`: args gives each runtime argument an example value
    (its type is what Triton would specialise on), constexprs the compile-time ones."""
    signature = {name: "constexpr" if name in constexprs else mangle_type(args[name])
                 for name in kernel.arg_names}
    source = ASTSource(kernel, signature, constexprs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": num_warps})


def ptxas_report(ptx: str, arch: int) -> tuple[int | None, int | None]:
    """(registers, spill bytes) of the kernel in `ptx`, by Triton's bundled ptxas -v."""
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "kernel.ptx"
        source.write_text(ptx)
        done = subprocess.run([str(ptxas), f"-arch=sm_{arch}a" if arch == 90 else
                               f"-arch=sm_{arch}", "-v", str(source), "-o",
                               str(Path(tmp) / "kernel.cubin")],
                              capture_output=True, text=True)
    report = done.stdout + done.stderr
    registers = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    return (int(registers.group(1)) if registers else None,
            int(spills.group(1)) + int(spills.group(2)) if spills else None)


def variants():
    """(kernel, variant name, args, constexprs, num_warps) for each launch the ops make, at a
    Llama-3-8B shape (32 query heads, 8 KV heads, head_dim 128, blocks of 16)."""
    for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        x = torch.empty(2, 4096, dtype=dtype)
        cache = torch.empty(4, 16, 8, 128, dtype=dtype)
        table = torch.empty(2, 4, dtype=torch.int64)
        yield (ops._write_kv_kernel, name,
               dict(k_ptr=x, v_ptr=x, k_cache_ptr=cache, v_cache_ptr=cache, slot_ptr=table,
                    stride_kt=6144, stride_kh=128, stride_vt=6144, stride_vh=128,
                    stride_cs=1024, stride_ch=128),
               dict(NKV=8, HD=128, NKV_P=8, HD_P=128), 4)
        for split in (False, True):
            for windowed in (False, True):
                yield (ops._decode_attention_kernel,
                       f"{name}{'-split' if split else ''}{'-window' if windowed else ''}",
                       dict(q_ptr=x, k_cache_ptr=cache, v_cache_ptr=cache, tables_ptr=table,
                            lens_ptr=table, out_ptr=x if not split else x.float(),
                            lse_ptr=x.float(), scale=0.1, window=4096, stride_qs=6144,
                            stride_qh=128, stride_cb=16384, stride_cp=1024, stride_ch=128,
                            stride_ts=64, stride_os=4096, stride_oh=128, stride_osplit=128,
                            stride_ls=256, stride_lh=8),
                       dict(GROUP=4, GROUP_P=4, HD=128, HD_P=128, BLOCK_SIZE=16, BLOCK_P=16,
                            PARTITION_BLOCKS=32, WINDOWED=windowed, SPLIT=split,
                            BLOCKS_PER_ITER=ops.DEFAULT_BLOCKS_PER_ITER), 4)
        yield (ops._decode_reduce_kernel, name,
               dict(part_ptr=x.float(), lse_ptr=x.float(), out_ptr=x, num_splits=8,
                    stride_ps=32768, stride_ph=1024, stride_psplit=128, stride_ls=256,
                    stride_lh=8, stride_os=4096, stride_oh=128),
               dict(HD=128, HD_P=128, SPLITS_P=8), 4)
        for add in (False, True):
            yield (ops._rms_norm_kernel, f"{name}{'-add' if add else ''}",
                   dict(x_ptr=x, delta_ptr=x, weight_ptr=x, out_ptr=x, eps=1e-5,
                        stride_x=4096, stride_delta=4096, stride_out=4096),
                   dict(H=4096, H_P=4096, ADD=add), ops._row_warps(4096))
        cos = torch.empty(8, 64)
        for by_token in (False, True):
            yield (ops._rotary_kernel, f"{name}{'-by-token' if by_token else ''}",
                   dict(x_ptr=x, cos_ptr=cos, sin_ptr=cos, positions_ptr=table,
                        stride_xt=6144, stride_xh=128, stride_cos=64, stride_sin=64),
                   dict(NH=40, HALF=64, NH_P=64, HALF_P=64, BY_TOKEN=by_token), 4)
        yield (ops._silu_mul_kernel, name,
               dict(gate_up_ptr=x, out_ptr=x, stride_in=28672, stride_out=14336),
               dict(I=14336, BLOCK=ops.SILU_BLOCK), 4)


def compile_all(arch: int = 90):
    """Compile every variant; yields a Compiled per variant (raises on a compile error)."""
    if ops.INTERPRETED:
        raise RuntimeError("unset TRITON_INTERPRET: interpreted kernels cannot be compiled")
    for kernel, variant, args, constexprs, num_warps in variants():
        start = time.perf_counter()
        compiled = compile_kernel(kernel, args, constexprs, arch, num_warps)
        seconds = time.perf_counter() - start
        registers, spills = ptxas_report(compiled.asm["ptx"], arch)
        yield Compiled(kernel.__name__, variant, round(seconds, 2), registers, spills)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability x 10")
    args = parser.parse_args(argv)
    for compiled in compile_all(args.arch):
        print(json.dumps(asdict(compiled)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
