"""`run_bench`: one workload against one target, summarised into a `BenchResult`."""

from __future__ import annotations

import sys
from dataclasses import asdict

from slotserve.lab.bench.stats import BenchResult, BenchSampling, summarize
from slotserve.lab.workload import Workload


def run_bench(workload: Workload, target, *, sampling: BenchSampling | None = None,
              label: str | None = None, progress: bool = False,
              trace_path: str | None = None) -> BenchResult:
    """Run the workload against the target (EngineTarget or OpenAITarget) once.

    trace_path: (engine) also write the run's iteration trace there (`slotserve timeline`).
    """
    sampling = sampling or BenchSampling()
    bar = _progress_bar(workload.num_completions, label) if progress else None
    try:
        run = target.run(workload, sampling, bar, trace_path)
    finally:
        if bar is not None:
            bar.close()
    run.config = {**run.config, "workload": dict(workload.params), "sampling": asdict(sampling)}
    return summarize(run, label or run.config.get("policy", target.name), target.name)


def _progress_bar(total: int, label: str | None):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=label or "requests", unit="req", dynamic_ncols=True,
                file=sys.stderr)
