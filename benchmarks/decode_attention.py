"""Decode attention, 30 layers' worth: the fused kernel against a baseline, interleaved.

    .venv/bin/python -m benchmarks.decode_attention --baseline HEAD~1 \\
        --out benchmarks/results/decode-attention.json

SmolLM2-135M's shapes (9 query heads over 3 KV heads of 64, blocks of 16), each
sequence's blocks spread at random over a pool, a separate cache per layer (so the K/V come
from memory, as in a decode step). The baseline is the fused kernel of another revision of
slotserve/csrc (`--baseline REV`, built under its own name) or, without it,
the torch reference (gather + SDPA). Reported per shape: the median time of the 30 layers
for each, and the median of the per-round ratios.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from slotserve.attention.torch_paged import decode_attention
from slotserve.lab.bench import write_report
from slotserve.model.cpu_ops import CFLAGS, load_cpu_ops

REPO = Path(__file__).resolve().parent.parent
SHAPES = [(1, 100), (1, 2000), (4, 300), (16, 200), (64, 130), (64, 300)]  # (seqs, context)
BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, NUM_HEADS, LAYERS = 16, 3, 64, 9, 30


def baseline_kernel(rev: str | None):
    """paged_decode_attention(q, k, v, tables, lens, scale) of revision `rev`, or torch's."""
    if rev is None:
        def reference(q, k_cache, v_cache, tables, lens, scale):
            mask = torch.arange(tables.shape[1] * BLOCK_SIZE)[None, :] < lens[:, None]
            return decode_attention(q, k_cache, v_cache, tables, mask, scale)
        return reference
    from torch.utils.cpp_extension import load

    def git(*args: str) -> bytes:
        return subprocess.run(["git", *args], cwd=REPO, check=True, capture_output=True).stdout

    # NOTE: the kernels were one cpu_ops.cpp before they were split by family: copy whatever
    # that revision's csrc holds and compile all its .cpp files.
    csrc, folder = "src/slotserve/csrc", Path(tempfile.mkdtemp())
    names = git("ls-tree", "--name-only", f"{rev}:{csrc}").decode().split()
    for file in names:
        (folder / file).write_bytes(git("show", f"{rev}:{csrc}/{file}"))
    sources = sorted(str(folder / file) for file in names if file.endswith(".cpp"))
    name = "slotserve_baseline_" + subprocess.run(
        ["git", "rev-parse", "--short", rev], cwd=REPO, check=True, capture_output=True,
        text=True).stdout.strip()
    return load(name=name, sources=sources, extra_cflags=CFLAGS,
                extra_ldflags=["-fopenmp"]).paged_decode_attention


def compare(kernels: dict, seqs: int, context: int, rounds: int) -> dict:
    max_blocks = -(-context // BLOCK_SIZE)
    num_blocks = seqs * max_blocks + 8
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    caches = [(torch.randn(shape), torch.randn(shape)) for _ in range(LAYERS)]
    tables = torch.randperm(num_blocks)[:seqs * max_blocks].view(seqs, max_blocks)
    lens = torch.full((seqs,), context)
    q = torch.randn(seqs, NUM_HEADS, HEAD_DIM)
    outs = [kernel(q, *caches[0], tables, lens, HEAD_DIM ** -0.5) for kernel in kernels.values()]
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-4)

    def all_layers_ms(kernel) -> float:
        start = time.perf_counter()
        for k_cache, v_cache in caches:
            kernel(q, k_cache, v_cache, tables, lens, HEAD_DIM ** -0.5)
        return (time.perf_counter() - start) * 1e3

    rounds_ms = {name: [] for name in kernels}
    for _ in range(rounds):
        for name, kernel in kernels.items():
            rounds_ms[name].append(statistics.median(all_layers_ms(kernel) for _ in range(5)))
    ratios = [b / f for f, b in zip(*rounds_ms.values())]
    kv_mb = seqs * context * NUM_KV_HEADS * HEAD_DIM * 4 * 2 * LAYERS / 1e6  # read per step
    return {"seqs": seqs, "context": context, "kv_mb": kv_mb, "rounds_ms": rounds_ms,
            "median_ms": {name: statistics.median(v) for name, v in rounds_ms.items()},
            "speedup_median": statistics.median(ratios)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", default=None, help="git revision of the kernel to compare")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    ops = load_cpu_ops()
    if ops is None:
        sys.exit("the fused CPU kernels did not build")
    baseline = f"kernel of {args.baseline}" if args.baseline else "torch reference"
    kernels = {"fused kernel": ops.paged_decode_attention,
               baseline: baseline_kernel(args.baseline)}
    rows = []
    for seqs, context in SHAPES:
        row = compare(kernels, seqs, context, args.rounds)
        med = row["median_ms"]
        print(f"{seqs:3d} x {context:4d} ({row['kv_mb']:4.0f} MB of K/V): fused "
              f"{med['fused kernel']:6.2f} ms, {baseline} {med[baseline]:6.2f} ms, "
              f"x{row['speedup_median']:.2f}", flush=True)
        rows.append(row)
    if args.out:
        write_report(args.out, rows=rows)


if __name__ == "__main__":
    main()
