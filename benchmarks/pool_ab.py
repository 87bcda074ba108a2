"""parallel_for on OpenMP against the kernels' thread pool, in one process, quiet and beside a
busy neighbour.

    .venv/bin/python -m benchmarks.pool_ab --rounds 5

One LLM (SmolLM2-135M, bf16 weights, 64 slots); 64 prompts of 32 tokens, 32 new tokens each,
with the pool off (at::parallel_for, the default) and on (`set_thread_pool`, as
SLOTSERVE_THREAD_POOL=1) in turn, the order swapped every round (a shared machine's stalls hit
both): median tok/s of each, quiet, then beside a process spinning on a core (`python -c
"while True: pass"`), and whether both gave the same tokens.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

PROMPTS = [[300 + (97 * i + 31 * j) % 3000 for j in range(32)] for i in range(64)]


def sampling():
    from slotserve.sampling import SamplingParams

    return SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


MODES = {"OpenMP": False, "pool": True}


def phase(label: str, llm, ops, rounds: int) -> dict[str, float]:
    """Median tok/s with the pool off and on over `rounds` alternating rounds."""
    params = sampling()
    rates: dict[str, list[float]] = {name: [] for name in MODES}
    tokens = {}
    for r in range(rounds):
        for name in list(MODES) if r % 2 == 0 else list(MODES)[::-1]:
            ops.set_thread_pool(MODES[name])
            start = time.perf_counter()
            out = llm.generate(PROMPTS, params, use_tqdm=False)
            rates[name].append(len(PROMPTS) * 32 / (time.perf_counter() - start))
            tokens[name] = [o.outputs[0].token_ids for o in out]
        print(f"{label} round {r}: " + " ".join(f"{n} {v[-1]:.0f}" for n, v in rates.items())
              + " tok/s", flush=True)
    med = {name: statistics.median(v) for name, v in rates.items()}
    a, b = med.values()
    same = len(set(map(str, tokens.values()))) == 1
    print(f"{label}: median " + " ".join(f"{n} {v:.0f}" for n, v in med.items())
          + f" tok/s, pool/OpenMP x{b / a:.2f}; same tokens: {same}", flush=True)
    return med


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    from slotserve.engine.llm import LLM
    from slotserve.model.cpu_ops import load_cpu_ops

    ops = load_cpu_ops()
    llm = LLM(quantization="bf16", max_num_seqs=64, num_blocks=512)
    llm.generate(PROMPTS[:4], sampling(), use_tqdm=False)  # warm-up
    quiet = phase("quiet", llm, ops, args.rounds)
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        busy = phase("beside a spinner", llm, ops, args.rounds)
    finally:
        spinner.kill()
        spinner.wait()
    print("beside the spinner, of quiet: "
          + " ".join(f"{n} {busy[n] / quiet[n]:.2f}" for n in MODES), flush=True)


if __name__ == "__main__":
    main()
