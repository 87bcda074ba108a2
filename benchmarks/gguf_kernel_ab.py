"""Two builds of the GGUF block kernel in one process, alternating pass by pass.

    .venv/bin/python -m benchmarks.gguf_kernel_ab MODEL.gguf A.so B.so \
        --rows 1 64

A.so, B.so: two builds of the fused CPU kernels (`load_cpu_ops().__file__` of each checkout;
the packed layout must be the same, and both take `activation_bits`: builds from 2cbb7b3
on). The file's linears (benchmarks/gguf_1row.py's roles) run
through A and B in turn, `--passes` times each, the order swapped every pass, so a shared
machine's stalls hit both alike: median ms and GB/s of each, their ratio, and whether the two
builds give the same bits.

NOTE: a role whose weights fit the last-level cache (a small model's o_proj: a few MB) is read
from it after the first pass, not from memory as in a decode step (44 GB/s seen on a 48 MB
L3 where memory gives ~25): `--flush-mb 128` reads that many MB of a buffer of its own before
every timed pass, so each pass starts with the role's weights out of the caches.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time

import torch


def load_build(path: str):
    name = path.rsplit("/", 1)[-1].split(".")[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def one_pass(ops, pairs, flush: torch.Tensor | None = None
             ) -> tuple[float, list[torch.Tensor]]:
    """Seconds of one pass over `pairs` (each kernel on its x) and the outputs; `flush`, if
    given, is summed first (untimed) to push the weights out of the caches."""
    if flush is not None:
        flush.sum()
    start = time.perf_counter()
    ys = [ops.quant_block_linear(x, k.codes, k.scales_mins, k.out_features, k.block_len,
                                 k.bits, activation_bits=k.activation_bits) for k, x in pairs]
    return time.perf_counter() - start, ys


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 64])
    p.add_argument("--passes", type=int, default=15)
    p.add_argument("--flush-mb", type=int, default=0,
                   help="read this many MB before every timed pass (the NOTE above; 0: none)")
    args = p.parse_args()
    flush = torch.ones(args.flush_mb << 18) if args.flush_mb else None  # fp32: 2^18 a MB

    from benchmarks.gguf_1row import kernels_by_role
    from slotserve.engine.llm import LLM
    from slotserve.model.linear_kernels import held_bytes

    builds = {"A": load_build(args.a), "B": load_build(args.b)}
    roles = kernels_by_role(LLM(model=args.model, max_num_seqs=8,
                                num_blocks=64).engine.runner.model)
    torch.manual_seed(0)
    for rows in args.rows:
        for key, kernels in roles.items():
            pairs = [(k, torch.randn(rows, k.block_len * k.codes.shape[1])) for k in kernels]
            held = sum(held_bytes(k) for k in kernels)
            outs = {name: one_pass(ops, pairs)[1] for name, ops in builds.items()}
            same = all(torch.equal(a, b) for a, b in zip(outs["A"], outs["B"]))
            times: dict[str, list[float]] = {"A": [], "B": []}
            for i in range(args.passes):
                for name in ("A", "B") if i % 2 == 0 else ("B", "A"):
                    times[name].append(one_pass(builds[name], pairs, flush)[0])
            med = {name: statistics.median(t) for name, t in times.items()}
            print(f"{rows:3d} rows {key:46s} A {med['A'] * 1e3:7.2f} ms "
                  f"{held / med['A'] / 1e9:5.1f} GB/s | B {med['B'] * 1e3:7.2f} ms "
                  f"{held / med['B'] / 1e9:5.1f} GB/s | A/B x{med['A'] / med['B']:.2f} "
                  f"{'bit-equal' if same else 'DIFFERENT'}", flush=True)


if __name__ == "__main__":
    main()
