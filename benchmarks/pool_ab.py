"""parallel_for on OpenMP against the kernels' thread pool, in one process, quiet and beside a
busy neighbour.

    .venv/bin/python -m benchmarks.pool_ab --rounds 4

One LLM (SmolLM2-135M, bf16 weights, 64 slots); 64 prompts of 32 tokens, 32 new tokens each,
in turn in the modes "OpenMP" (the pool off: SLOTSERVE_THREAD_POOL=0, at::parallel_for),
"pool" (the default: the pool while other processes busy this process's CPUs, else OpenMP:
csrc/parallel.h) and, with --everywhere, "everywhere" (SLOTSERVE_THREAD_POOL=1: every range
on the pool), the order rotated every round (a shared machine's stalls hit all): median tok/s
of each, quiet, then beside a process spinning on a core (`python -c "while True: pass"`);
whether all gave the same tokens, and how many chunks the pool's workers ran in each mode
(0: every range ran on OpenMP).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

PROMPTS = [[300 + (97 * i + 31 * j) % 3000 for j in range(32)] for i in range(64)]


def sampling():
    from slotserve.sampling import SamplingParams

    return SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


# mode: (set_thread_pool's argument, SLOTSERVE_THREAD_POOL while it is called)
MODES = {"OpenMP": (False, "0"), "pool": (True, None), "everywhere": (True, "1")}
DEFAULT_MODES = ("OpenMP", "pool")


def set_mode(ops, name: str) -> None:
    """Puts parallel_for in mode `name` (MODES)."""
    on, variable = MODES[name]
    if variable is None:
        os.environ.pop("SLOTSERVE_THREAD_POOL", None)
    else:
        os.environ["SLOTSERVE_THREAD_POOL"] = variable
    ops.set_thread_pool(on)


def phase(label: str, llm, ops, rounds: int, names: list[str]) -> dict[str, float]:
    """Median tok/s of each mode in `names` over `rounds` rounds, the order rotated each
    round."""
    params = sampling()
    rates: dict[str, list[float]] = {name: [] for name in names}
    tokens = {}
    worker_chunks = dict.fromkeys(names, 0)  # chunks the pool's workers ran: 0 on OpenMP
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            set_mode(ops, name)
            chunks = ops.pool_worker_chunks()
            start = time.perf_counter()
            out = llm.generate(PROMPTS, params, use_tqdm=False)
            rates[name].append(len(PROMPTS) * 32 / (time.perf_counter() - start))
            worker_chunks[name] += ops.pool_worker_chunks() - chunks
            tokens[name] = [o.outputs[0].token_ids for o in out]
        print(f"{label} round {r}: " + " ".join(f"{n} {v[-1]:.0f}" for n, v in rates.items())
              + " tok/s", flush=True)
    med = {name: statistics.median(v) for name, v in rates.items()}
    same = len(set(map(str, tokens.values()))) == 1
    print(f"{label}: median " + " ".join(f"{n} {v:.0f}" for n, v in med.items()) + " tok/s, "
          + ", ".join(f"{n}/OpenMP x{med[n] / med['OpenMP']:.2f}" for n in names[1:])
          + f"; same tokens: {same}; chunks run by pool workers: {worker_chunks}", flush=True)
    return med


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--everywhere", action="store_true",
                   help="also SLOTSERVE_THREAD_POOL=1 (every range on the pool)")
    args = p.parse_args()
    names = [*DEFAULT_MODES, *(["everywhere"] if args.everywhere else [])]
    from slotserve.engine.llm import LLM
    from slotserve.model.cpu_ops import load_cpu_ops

    ops = load_cpu_ops()
    initial = os.environ.get("SLOTSERVE_THREAD_POOL")
    llm = LLM(quantization="bf16", max_num_seqs=64, num_blocks=512)
    llm.generate(PROMPTS, sampling(), use_tqdm=False)  # warm-up: round 0's first mode ran slow
    quiet = phase("quiet", llm, ops, args.rounds, names)
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        busy = phase("beside a spinner", llm, ops, args.rounds, names)
    finally:
        spinner.kill()
        spinner.wait()
        set_mode(ops, "pool")
        if initial is not None:
            os.environ["SLOTSERVE_THREAD_POOL"] = initial
    print("beside the spinner, of quiet: "
          + " ".join(f"{n} {busy[n] / quiet[n]:.2f}" for n in names), flush=True)


if __name__ == "__main__":
    main()
