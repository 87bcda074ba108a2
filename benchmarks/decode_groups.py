"""Decode attention in length groups vs one padded batch, on W with 16 slots (and static).

    .venv/bin/python -m benchmarks.decode_groups --rounds 2

With 16 slots, continuous batching mixes new requests (40-token contexts) with old ones (up
to 420): one padded decode batch makes every sequence gather as many K/V blocks as the
longest. `attention.metadata` groups decodes by length; this script turns that off
(GROUP_MIN_SAVED_BLOCKS = infinity: one group) for an A/B run in one process, interleaved.
NOTE: the fused CPU decode kernel reads each sequence's own blocks (no padding), so with it
(the default on CPU) decodes are one group anyway; `--no-padded` then leaves only the
interleaved continuous vs static comparison.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from benchmarks.perf import workload_w
from slotserve.attention import metadata
from slotserve.lab.bench import BenchSampling, EngineTarget, format_table, run_bench


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--no-padded", action="store_true",
                   help="leave out the one-padded-batch variant (continuous vs static only)")
    args = p.parse_args()
    target = EngineTarget.load(max_num_batched_tokens=512, max_model_len=1024)
    grouped = metadata.GROUP_MIN_SAVED_BLOCKS
    systems = {"continuous, grouped decodes": ("continuous", grouped),
               "continuous, one padded batch": ("continuous", float("inf")),
               "static, grouped decodes": ("static", grouped)}
    if args.no_padded:
        del systems["continuous, one padded batch"]
    results, throughput = [], {name: [] for name in systems}
    for round_ in range(args.rounds):
        for name, (policy, min_saved) in systems.items():
            metadata.GROUP_MIN_SAVED_BLOCKS = min_saved
            label = f"{name} {args.slots} slots (round {round_ + 1})"
            print(f"running {label} ...", file=sys.stderr, flush=True)
            result = run_bench(workload_w(), target.configured(batching=policy,
                                                                 max_num_seqs=args.slots),
                               sampling=BenchSampling(), label=label)
            results.append(result)
            throughput[name].append(result.to_dict()["output_throughput"])
    metadata.GROUP_MIN_SAVED_BLOCKS = grouped
    print(format_table(results))
    for name, values in throughput.items():
        print(f"{name}: median {statistics.median(values):.1f} output tok/s over "
              f"{len(values)} rounds {[round(v, 1) for v in values]}")


if __name__ == "__main__":
    main()
