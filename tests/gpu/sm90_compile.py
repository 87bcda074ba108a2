"""Compile Triton kernels for the H200 (sm_90) without a GPU, as the runtime would specialise
them, and read ptxas's resource report: what tests/gpu's compile tests assert on.

Unlike slotserve.gpu.aot.compile_kernel, the arguments get the runtime's specialisation:
every pointer and every integer divisible by 16 is marked so (`tt.divisibility`), as
Triton's JIT marks aligned tensors and strides. NOTE: without it loads are not vectorised
nor software-pipelined, and registers and spills are a worst case, not what runs.
In a subprocess: the session's kernels may be the interpreter's, which cannot be compiled.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

COMPILE = """
import importlib, json, sys, torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import mangle_type
from slotserve.gpu import aot

module, kernel_name, variants = json.loads(sys.argv[1])
kernel = getattr(importlib.import_module(module), kernel_name)
for variant in variants:
    args = {name: torch.empty(value["shape"], dtype=getattr(torch, value["dtype"]))
            if isinstance(value, dict) else value for name, value in variant["args"].items()}
    constexprs = variant["constexprs"]
    signature = {name: "constexpr" if name in constexprs else mangle_type(args[name])
                 for name in kernel.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
             if name in args and (isinstance(args[name], torch.Tensor)
                                  or type(args[name]) is int and args[name] % 16 == 0)}
    compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": variant["num_warps"],
                                       "num_stages": variant.get("num_stages", 3)})
    registers, spills = aot.ptxas_report(compiled.asm["ptx"], 90)
    ttgir = compiled.asm["ttgir"]
    print(json.dumps(dict(name=variant["name"], registers=registers, spill_bytes=spills,
                          wgmma="wgmma" in compiled.asm["ptx"],
                          async_copies=ttgir.count("async_copy_global_to_local"),
                          shared_bytes=compiled.metadata.shared)), flush=True)
"""


def tensor(*shape: int, dtype: str = "bfloat16") -> dict:
    """An argument that is a tensor of this shape and dtype (only its type matters)."""
    return {"shape": list(shape), "dtype": dtype}


def compile_for_sm90(module: str, kernel: str, variants: list[dict]) -> dict[str, dict]:
    """Compile `module.kernel` at each variant ({"name", "args", "constexprs", "num_warps",
    optional "num_stages"}; args: numbers or tensor(...)) -> per name: registers,
    spill_bytes, wgmma (Hopper's tensor-core MMA used), async_copies (loads software-
    pipelined), shared_bytes. Raises AssertionError with the compiler's error."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", COMPILE, json.dumps([module, kernel,
                                                                      variants])],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return {c["name"]: c for c in map(json.loads, done.stdout.splitlines())}
