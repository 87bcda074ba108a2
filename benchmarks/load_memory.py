"""A model's loading in process: seconds and memory of `LLMEngine.from_config`, trees interleaved.

    .venv/bin/python -m benchmarks.load_memory --models A.gguf,/path/to/hf_dir --rounds 3 \
        --quantization bf16 --trees before=/path/to/old/checkout after=.

Each (model, tree) loads `--rounds` times in a fresh process with that tree's `src` on
PYTHONPATH, the trees' order rotated each round; before each load the model's files are read
once (the page cache warm: a VM's reclaim evicts them between runs otherwise). The kernels
are built (or found) before the clock starts. Per load: seconds in `LLMEngine.from_config`
(`max_num_seqs=4, num_blocks=64`, the quantization given), VmRSS after it (what the loaded
model holds), VmHWM (the peak; it counts a file's mapped pages too), and the anonymous huge
pages then; per (model, tree): the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks.startup import parse_trees, warm_page_cache

# One load, in the child: its figures as one JSON line.
_LOAD = """
import json, sys, time
from slotserve.config import engine_config
from slotserve.engine.llm_engine import LLMEngine
from slotserve.model.cpu_ops import load_cpu_ops
load_cpu_ops()
start = time.perf_counter()
engine = LLMEngine.from_config(engine_config(model=sys.argv[1], max_num_seqs=4, num_blocks=64,
                                             quantization=sys.argv[2]))
seconds = time.perf_counter() - start
def kib(path, key):
    return next(int(line.split()[1]) for line in open(path) if line.startswith(key))
print(json.dumps({"seconds": seconds, "rss_mib": kib("/proc/self/status", "VmRSS") / 1024,
                  "hwm_mib": kib("/proc/self/status", "VmHWM") / 1024,
                  "huge_mib": kib("/proc/self/smaps_rollup", "AnonHugePages") / 1024}))
"""


def load_once(tree: str, model: str, quantization: str) -> dict:
    """The figures of one load of `model` by `tree`'s slotserve, in a fresh process."""
    env = {**os.environ, "PYTHONPATH": f"{tree}/src"}
    done = subprocess.run([sys.executable, "-c", _LOAD, model, quantization], env=env,
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", required=True, help="model files or HF directories, comma-separated")
    p.add_argument("--trees", nargs="+", default=["this=."],
                   help="NAME=DIR: checkouts of slotserve to load with")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quantization", default="bf16", help="slotserve's --quantization")
    args = p.parse_args()
    trees = parse_trees(args.trees)
    names, runs = list(trees), {}
    for r in range(args.rounds):
        for model in args.models.split(","):
            for name in names[r % len(names):] + names[:r % len(names)]:
                warm_page_cache(model)
                figures = load_once(trees[name], model, args.quantization)
                runs.setdefault((Path(model).name, name), []).append(figures)
                print(f"round {r} {Path(model).name} {name}: load {figures['seconds']:.2f} s, "
                      f"VmRSS {figures['rss_mib']:.0f} MiB, VmHWM {figures['hwm_mib']:.0f} MiB, "
                      f"huge pages {figures['huge_mib']:.0f} MiB", flush=True)
    print("\nmodel | tree | load s (runs) | median | VmRSS MiB (median) | VmHWM MiB (median)")
    for (model, name), values in runs.items():
        seconds = [v["seconds"] for v in values]
        print(f"{model} | {name} | {', '.join(f'{s:.2f}' for s in seconds)} | "
              f"{statistics.median(seconds):.2f} | "
              f"{statistics.median(v['rss_mib'] for v in values):.0f} | "
              f"{statistics.median(v['hwm_mib'] for v in values):.0f}")


if __name__ == "__main__":
    main()
