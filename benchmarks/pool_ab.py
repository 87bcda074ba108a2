"""Two builds of the fused CPU kernels in one process, quiet and beside a busy neighbour.

    flock /tmp/bench.lock .venv/bin/python -m benchmarks.pool_ab A.so B.so --rounds 5

A.so, B.so: two builds' modules (`load_cpu_ops().__file__` of each checkout; e.g. an OpenMP
build and a thread-pool build). One LLM per build (SmolLM2-135M, bf16 weights, 64 slots);
64 prompts of 32 tokens, 32 new tokens each, through A and B in turn, the order swapped every
round (a shared machine's stalls hit both): median tok/s of each, quiet, then beside a process
spinning on a core (`python -c "while True: pass"`), and whether both gave the same tokens.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from benchmarks.gguf_kernel_ab import load_build

PROMPTS = [[300 + (97 * i + 31 * j) % 3000 for j in range(32)] for i in range(64)]


def sampling():
    from slotserve.sampling import SamplingParams

    return SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


def engines(builds: dict) -> dict:
    """One LLM per build: model/kernels.py loads the kernels through cpu_ops.load_cpu_ops."""
    from slotserve.engine.llm import LLM
    from slotserve.model import cpu_ops

    original, llms = cpu_ops.load_cpu_ops, {}
    try:
        for name, module in builds.items():
            cpu_ops.load_cpu_ops = lambda march="native", module=module: module
            llms[name] = LLM(quantization="bf16", max_num_seqs=64, num_blocks=512)
    finally:
        cpu_ops.load_cpu_ops = original
    return llms


def phase(label: str, llms: dict, rounds: int) -> dict[str, float]:
    """Median tok/s of each build over `rounds` alternating rounds."""
    params = sampling()
    rates: dict[str, list[float]] = {name: [] for name in llms}
    tokens = {}
    for r in range(rounds):
        for name in list(llms) if r % 2 == 0 else list(llms)[::-1]:
            start = time.perf_counter()
            out = llms[name].generate(PROMPTS, params, use_tqdm=False)
            rates[name].append(len(PROMPTS) * 32 / (time.perf_counter() - start))
            tokens[name] = [o.outputs[0].token_ids for o in out]
        print(f"{label} round {r}: " + " ".join(f"{n} {v[-1]:.0f}" for n, v in rates.items())
              + " tok/s", flush=True)
    med = {name: statistics.median(v) for name, v in rates.items()}
    a, b = med.values()
    print(f"{label}: median " + " ".join(f"{n} {v:.0f}" for n, v in med.items())
          + f" tok/s, B/A x{b / a:.2f}; same tokens: {len(set(map(str, tokens.values()))) == 1}",
          flush=True)
    return med


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    llms = engines({"A": load_build(args.a), "B": load_build(args.b)})
    for llm in llms.values():
        llm.generate(PROMPTS[:4], sampling(), use_tqdm=False)  # warm-up
    quiet = phase("quiet", llms, args.rounds)
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        busy = phase("beside a spinner", llms, args.rounds)
    finally:
        spinner.kill()
        spinner.wait()
    print("beside the spinner, of quiet: "
          + " ".join(f"{n} {busy[n] / quiet[n]:.2f}" for n in llms), flush=True)


if __name__ == "__main__":
    main()
