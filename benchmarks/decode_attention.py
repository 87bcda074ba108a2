"""Decode attention, 30 layers' worth: the fused kernel against a baseline, interleaved.

    .venv/bin/python -m benchmarks.decode_attention --baseline HEAD~1 \\
        --out benchmarks/results/decode-attention.json
    .venv/bin/python -m benchmarks.decode_attention --baseline HEAD~1 --cache-dtype bfloat16
    .venv/bin/python -m benchmarks.decode_attention --cache-dtypes bfloat16,int8 \\
        --shapes 64x512,64x1024,64x2048 --layers 8 \\
        --out benchmarks/results/decode-attention-int8.json

SmolLM2-135M's shapes (9 query heads over 3 KV heads of 64, blocks of 16), each
sequence's blocks spread at random over a pool, a separate cache per layer (so the K/V come
from memory, as in a decode step). The baseline is the fused kernel of another revision of
slotserve/csrc (`--baseline REV`, built under its own name) or, without it,
the torch reference (gather + SDPA), over caches of `--cache-dtype` (float32 unless
given; the engine's default is bfloat16). Reported per shape: the median time of the 30 layers
for each, and the median of the per-round ratios.

--cache-dtypes A,B: instead, this revision's fused kernel over the same K/V stored as each
cache dtype (float32, bfloat16, int8: `--kv-cache-dtype`), interleaved round by round, each
checked against the torch reference over its own cache; the ratio is B's speed-up over A.
--layers: fewer caches (timed as that many layers) keep long contexts within memory; at 64
sequences of 512 positions one layer's bf16 K/V (25 MB) already outgrow the CPU's caches.
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

from slotserve.attention import kv_int8
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


def as_cache(x: torch.Tensor, dtype: str) -> torch.Tensor:
    """fp32 K or V (num_blocks, bs, nkv, hd) stored as a `dtype` cache."""
    return kv_int8.quantize(x) if dtype == "int8" else x.to(getattr(torch, dtype))


def decode_shape(seqs: int, context: int, num_heads: int = NUM_HEADS):
    """(num_blocks, tables (seqs, max_blocks) of scattered blocks, lens, q)."""
    max_blocks = -(-context // BLOCK_SIZE)
    num_blocks = seqs * max_blocks + 8
    tables = torch.randperm(num_blocks)[:seqs * max_blocks].view(seqs, max_blocks)
    return num_blocks, tables, torch.full((seqs,), context), torch.randn(seqs, num_heads,
                                                                          HEAD_DIM)


def time_interleaved(entries: dict, q, tables, lens, rounds: int) -> dict[str, list[float]]:
    """name -> (kernel, caches): each round times every entry over all its caches (the
    median of 5 passes), entry after entry; the per-round times by name."""
    def all_layers_ms(kernel, caches) -> float:
        start = time.perf_counter()
        for k_cache, v_cache in caches:
            kernel(q, k_cache, v_cache, tables, lens, HEAD_DIM ** -0.5)
        return (time.perf_counter() - start) * 1e3

    rounds_ms = {name: [] for name in entries}
    for _ in range(rounds):
        for name, (kernel, caches) in entries.items():
            rounds_ms[name].append(statistics.median(all_layers_ms(kernel, caches)
                                                     for _ in range(5)))
    return rounds_ms


def summary(seqs: int, context: int, kv_mb, rounds_ms: dict, faster: str, **extra) -> dict:
    """The row of one shape: per-round times, their medians and minima, and the median of
    the per-round speed-ups of entry `faster` over the other (its time / the other's)."""
    other = next(name for name in rounds_ms if name != faster)
    ratios = [b / f for f, b in zip(rounds_ms[faster], rounds_ms[other])]
    return {"seqs": seqs, "context": context, "kv_mb": kv_mb, **extra, "rounds_ms": rounds_ms,
            "median_ms": {name: statistics.median(v) for name, v in rounds_ms.items()},
            "min_ms": {name: min(v) for name, v in rounds_ms.items()},
            "speedup_median": statistics.median(ratios)}


def kv_read_mb(seqs: int, context: int, layers: int, cache: torch.Tensor) -> float:
    """MB of K and V a step reads from caches like `cache` (num_blocks, bs, nkv, row)."""
    head_rows = seqs * context * cache.shape[2] * 2 * layers
    return head_rows * cache.shape[-1] * cache.element_size() / 1e6


def compare(kernels: dict, seqs: int, context: int, rounds: int, layers: int = LAYERS,
            dtype: str = "float32", heads: tuple[int, int] = (NUM_HEADS, NUM_KV_HEADS)) -> dict:
    num_blocks, tables, lens, q = decode_shape(seqs, context, heads[0])
    shape = (num_blocks, BLOCK_SIZE, heads[1], HEAD_DIM)
    caches = [(as_cache(torch.randn(shape), dtype), as_cache(torch.randn(shape), dtype))
              for _ in range(layers)]
    outs = [kernel(q, *caches[0], tables, lens, HEAD_DIM ** -0.5) for kernel in kernels.values()]
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-4)
    rounds_ms = time_interleaved({name: (kernel, caches) for name, kernel in kernels.items()},
                                 q, tables, lens, rounds)
    kv_mb = kv_read_mb(seqs, context, layers, caches[0][0])
    return summary(seqs, context, kv_mb, rounds_ms, faster=next(iter(kernels)), dtype=dtype,
                   layers=layers, heads=list(heads))


def compare_cache_dtypes(kernel, dtypes: list[str], seqs: int, context: int, layers: int,
                         rounds: int) -> dict:
    """The fused kernel over the same random K/V stored as each dtype, `layers` caches."""
    num_blocks, tables, lens, q = decode_shape(seqs, context)
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    caches = {dtype: [] for dtype in dtypes}
    for _ in range(layers):
        k, v = torch.randn(shape), torch.randn(shape)
        for dtype in dtypes:
            caches[dtype].append((as_cache(k, dtype), as_cache(v, dtype)))
    mask = torch.arange(tables.shape[1] * BLOCK_SIZE)[None, :] < lens[:, None]
    for dtype in dtypes:  # the kernel over each cache = the torch reference over it
        torch.testing.assert_close(kernel(q, *caches[dtype][0], tables, lens, HEAD_DIM ** -0.5),
                                   decode_attention(q, *caches[dtype][0], tables, mask,
                                                    HEAD_DIM ** -0.5), atol=1e-5, rtol=1e-4)
    rounds_ms = time_interleaved({dtype: (kernel, caches[dtype]) for dtype in dtypes}, q,
                                 tables, lens, rounds)
    kv_mb = {dtype: kv_read_mb(seqs, context, layers, caches[dtype][0][0]) for dtype in dtypes}
    return summary(seqs, context, kv_mb, rounds_ms, faster=dtypes[1], layers=layers)


def parse_heads(text: str) -> tuple[int, int]:
    """"14/2" -> (14, 2): query heads / KV heads."""
    num_heads, num_kv_heads = (int(n) for n in text.split("/"))
    if num_heads % num_kv_heads:
        raise argparse.ArgumentTypeError(f"{num_heads} query heads over {num_kv_heads} KV heads")
    return num_heads, num_kv_heads


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """"64x512,1x2048" -> [(64, 512), (1, 2048)] (sequences x context positions)."""
    return [tuple(int(n) for n in shape.split("x")) for shape in text.split(",")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", default=None, help="git revision of the kernel to compare")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--cache-dtypes", default=None,
                   help="A,B: the fused kernel over caches of these dtypes (float32, "
                        "bfloat16, int8) instead of against a baseline")
    p.add_argument("--cache-dtype", default="float32", choices=["float32", "bfloat16", "int8"],
                   help="against a baseline: the caches' dtype (default: float32)")
    p.add_argument("--shapes", default=None, type=parse_shapes,
                   help="SEQSxCONTEXT,...: the shapes to time (default: "
                        + ",".join(f"{s}x{c}" for s, c in SHAPES) + ")")
    p.add_argument("--layers", type=int, default=LAYERS,
                   help=f"caches timed, one per layer (default: {LAYERS})")
    p.add_argument("--heads", default=f"{NUM_HEADS}/{NUM_KV_HEADS}", type=parse_heads,
                   help="QUERY/KV heads against a baseline (default: SmolLM2's "
                        f"{NUM_HEADS}/{NUM_KV_HEADS}; Qwen2.5-0.5B's 14/2)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch's threads, which the kernel runs on (default: torch's own)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ops = load_cpu_ops()
    if ops is None:
        sys.exit("the fused CPU kernels did not build")
    shapes = args.shapes or SHAPES
    if args.cache_dtypes:
        run_cache_dtypes(ops, args.cache_dtypes.split(","), shapes, args)
        return
    baseline = f"kernel of {args.baseline}" if args.baseline else "torch reference"
    kernels = {"fused kernel": ops.paged_decode_attention,
               baseline: baseline_kernel(args.baseline)}
    rows = []
    for seqs, context in shapes:
        row = compare(kernels, seqs, context, args.rounds, args.layers, args.cache_dtype,
                      args.heads)
        med = row["median_ms"]
        print(f"{seqs:3d} x {context:4d} ({row['kv_mb']:4.0f} MB of K/V): fused "
              f"{med['fused kernel']:6.2f} ms, {baseline} {med[baseline]:6.2f} ms, "
              f"x{row['speedup_median']:.2f}", flush=True)
        rows.append(row)
    if args.out:
        write_report(args.out, rows=rows)


def run_cache_dtypes(ops, dtypes: list[str], shapes, args) -> None:
    """--cache-dtypes: one row per shape, printed and written to --out."""
    if len(dtypes) != 2 or not set(dtypes) <= {"float32", "bfloat16", "int8"}:
        sys.exit(f"--cache-dtypes: two of float32, bfloat16, int8; got {dtypes}")
    rows = []
    for seqs, context in shapes:
        row = compare_cache_dtypes(ops.paged_decode_attention, dtypes, seqs, context,
                                   args.layers, args.rounds)
        med, mb = row["median_ms"], row["kv_mb"]
        print(f"{seqs:3d} x {context:4d}, {args.layers} layers: "
              + ", ".join(f"{d} {med[d]:7.2f} ms (min {row['min_ms'][d]:7.2f}; {mb[d]:4.0f} MB)"
                          for d in dtypes)
              + f", {dtypes[1]} x{row['speedup_median']:.2f}", flush=True)
        rows.append(row)
    if args.out:
        write_report(args.out, rows=rows, cache_dtypes=dtypes, layers=args.layers,
                     threads=torch.get_num_threads())


if __name__ == "__main__":
    main()
