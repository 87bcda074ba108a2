"""Two builds of the fused CPU kernels in one process: an engine on each, generating in turn.

    .venv/bin/python -m benchmarks.engine_ab A.so B.so --batch 1 64 --rounds 7

A.so, B.so: two builds of the kernels (`load_cpu_ops().__file__` of each checkout, e.g. the
one before a kernel change and the one after; their Python side must agree, as it does
for a change inside csrc/). Each engine (the embedded SmolLM2 or `--model`, `--quantization`,
64 slots) is built with its build's kernels; then every round runs each batch size on A and
on B in turn, the order swapped every round, so a shared machine's slow minutes hit both alike.
Reported per batch: the median output tok/s of each, the median of the per-round ratios
B / A, and whether both gave the same tokens (greedy).
"""

from __future__ import annotations

import argparse
import statistics
import time
from unittest import mock

from benchmarks.gguf_kernel_ab import load_build

PROMPTS = [f"Tell me fact number {i} about the roads of the Roman empire." for i in range(64)]
# --prefix-sentences: this sentence (16 tokens) repeated before every prompt, a long context
PASSAGE = "The Roman roads ran straight from town to town across hills, rivers and marshes. "


def engine_on(build, quantization: str, model: str | None = None):
    """An LLM on `model` (default: the embedded one) whose kernels are `build`
    (resolve_kernels' load_cpu_ops returns it)."""
    from slotserve import LLM
    from slotserve.model import cpu_ops

    with mock.patch.object(cpu_ops, "load_cpu_ops", lambda *_args, **_kw: build):
        return LLM(model, quantization=quantization, max_num_seqs=64)


def timed(llm, batch: int, max_tokens: int,
          prefix: str = "") -> tuple[float, list[list[int]]]:
    """(output tok/s, each completion's tokens) of `batch` prompts at once, each after
    `prefix` (a shared one: after the first run the prefix cache holds it)."""
    from slotserve import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)
    start = time.perf_counter()
    outputs = llm.generate([prefix + p for p in PROMPTS[:batch]], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    return sum(map(len, tokens)) / seconds, tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--quantization", default="bf16")
    p.add_argument("--model", default=None, help="a model path (default: the embedded one)")
    p.add_argument("--prefix-sentences", type=int, default=0,
                   help="a passage of this many sentences (16 tokens each) before every "
                        "prompt: decode over a long context (default: none)")
    args = p.parse_args()
    prefix = PASSAGE * args.prefix_sentences

    engines = {name: engine_on(load_build(path), args.quantization, args.model)
               for name, path in (("A", args.a), ("B", args.b))}
    for llm in engines.values():  # warm-up: every batch size once
        for batch in args.batch:
            timed(llm, batch, 8, prefix)
    rates = {(name, batch): [] for name in engines for batch in args.batch}
    same = dict.fromkeys(args.batch, True)
    for round_index in range(args.rounds):
        order = list(engines) if round_index % 2 == 0 else list(reversed(engines))
        for batch in args.batch:
            tokens = {}
            for name in order:
                rate, tokens[name] = timed(engines[name], batch, args.max_tokens, prefix)
                rates[name, batch].append(rate)
            same[batch] &= tokens["A"] == tokens["B"]
    for batch in args.batch:
        a, b = rates["A", batch], rates["B", batch]
        ratio = statistics.median(y / x for x, y in zip(a, b))
        print(f"batch {batch:3d}: A {statistics.median(a):7.1f} tok/s (rounds "
              f"{min(a):.1f}-{max(a):.1f}), B {statistics.median(b):7.1f} "
              f"({min(b):.1f}-{max(b):.1f}), B/A x{ratio:.3f} (median of rounds); "
              f"same tokens: {same[batch]}", flush=True)


if __name__ == "__main__":
    main()
