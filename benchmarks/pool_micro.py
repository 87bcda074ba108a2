"""parallel_for's per-call cost on the kernels' pool against OpenMP (at::parallel_for), on
synthetic jobs: a harness (benchmarks/pool_micro.cpp) built with csrc/parallel.cpp alone.

    .venv/bin/python -m benchmarks.pool_micro --rounds 5

Each case ("n x units"): parallel_for(0, n, 1) calls whose indices each do `units` steps of
dependent floating-point work (~1.1 ns a step on a Zen 4 EPYC), inside a SpinScope (as the
decode stack) or not, and with "OMP/k" one OpenMP region (at::parallel_for over 2 indices, as
a torch op) every k calls; every range on the pool (SLOTSERVE_THREAD_POOL=1) and on OpenMP
alternate, medians of the rounds: wall and process CPU us per call. Then how long each
leaves its idle threads spinning after a call.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "src" / "slotserve" / "csrc"
HERE = Path(__file__).resolve().parent

# name: (calls, n, units, spin, omp_every, omp_units)
CASES = {
    "2 x 2000, spin": (5000, 2, 2000, True, 0, 0),
    "18 x 1000, spin": (5000, 18, 1000, True, 0, 0),
    "64 x 3000, spin": (1000, 64, 3000, True, 0, 0),
    "2 x 10000, spin, OMP/10": (2000, 2, 10000, True, 10, 20000),
    "18 x 3000, spin, OMP/10": (2000, 18, 3000, True, 10, 20000),
    "64 x 3000, OMP/1": (1000, 64, 3000, False, 1, 50000),
    "18 x 10000, OMP/1": (1000, 18, 10000, False, 1, 20000),
}

def build():
    """The harness's module (built once per version of its sources)."""
    from torch.utils.cpp_extension import load

    sources = [HERE / "pool_micro.cpp", CSRC / "parallel.cpp"]
    key = hashlib.sha256(b"".join(p.read_bytes() for p in [*sources, CSRC / "parallel.h"]))
    return load(name=f"slotserve_pool_micro_{key.hexdigest()[:12]}",
                sources=[str(s) for s in sources], extra_include_paths=[str(CSRC)],
                extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
                verbose=False)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--case", action="append", help="only these cases (names as listed)")
    args = p.parse_args()
    os.environ["SLOTSERVE_THREAD_POOL"] = "1"  # every range on the pool when it is on
    m = build()
    cases = {k: v for k, v in CASES.items() if not args.case or k in args.case}
    print(f"{'case':28s} {'OpenMP us':>10s} {'pool us':>9s} {'pool/OMP':>8s}"
          f" {'OMP cpu':>8s} {'pool cpu':>8s}")
    for name, (calls, n, units, spin, every, omp_units) in cases.items():
        got: dict[bool, list] = {False: [], True: []}
        for r in range(args.rounds):
            for on in (False, True) if r % 2 == 0 else (True, False):
                m.set_thread_pool(on)
                m.jobs(calls // 10, n, units, spin, every, omp_units)  # warm
                got[on].append(m.jobs(calls, n, units, spin, every, omp_units))
        wall = {on: statistics.median(x[0] for x in v) for on, v in got.items()}
        cpu = {on: statistics.median(x[1] for x in v) for on, v in got.items()}
        print(f"{name:28s} {wall[False]:10.2f} {wall[True]:9.2f} {wall[True] / wall[False]:8.2f}"
              f" {cpu[False]:8.1f} {cpu[True]:8.1f}", flush=True)
    for on in (False, True):
        m.set_thread_pool(on)
        idle = [m.idle_cpu(20000, True) for _ in range(3)]
        print(f"{'pool' if on else 'OpenMP'}: CPU us in the 20 ms after a call (in a SpinScope):"
              f" {[round(x) for x in idle]}")


if __name__ == "__main__":
    main()
