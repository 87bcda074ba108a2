"""`slotserve bench`: a load generator and report for the engine or any OpenAI-compatible server.

    result = run_bench(workload, EngineTarget.load(max_num_seqs=16))      # in-process
    result = run_bench(workload, OpenAITarget("http://127.0.0.1:8000"))   # over HTTP
    print(format_table([result])); json.dumps(result.to_dict())

Targets:
- `EngineTarget`: an LLMEngine in this process, driven `step()` by `step()`; each request is
  added when its arrival time comes, and its latencies come from the engine's RequestMetrics.
  Weights are loaded once; every run builds a fresh engine on them (fresh KV pool and stats).
- `OpenAITarget`: streaming /v1/completions or /v1/chat/completions; TTFT and ITL are measured
  client-side from chunk arrival times (so the same tool measures llama-server or vLLM).

Metrics (as in the design's words; vLLM's benchmark_serving computes the same ones):
- TTFT: first token - arrival (over HTTP: first text chunk - request sent).
- TPOT: (last token - first token) / (output tokens - 1); requests with one token have none.
- ITL: every gap between two consecutive tokens (HTTP: chunks) of one request, pooled.
- e2e: finish - arrival. Percentiles are numpy's (linear interpolation), in ms.
- utilisation (engine only): busy slot-iterations / (max_num_seqs x iterations), where a
  slot is busy if its request processed tokens in that iteration (the seed's definition).
- duration: from the start of the run (t=0 of the arrival schedule) to the last finish.

Modules: `stats` (records, latency statistics, the summary), `targets` (engine and HTTP),
`client` (the HTTP target's streaming client), `runner` (`run_bench`), `report` (tables,
JSON reports, the knee plot). The command itself is `slotserve.commands.bench`.
"""

from slotserve.lab.bench.report import (
    format_detail,
    format_ratios,
    format_table,
    plot_knee,
    write_report,
)
from slotserve.lab.bench.runner import run_bench
from slotserve.lab.bench.stats import (
    BenchResult,
    BenchSampling,
    LatencyStats,
    RequestRecord,
    RunStats,
    compare_ratios,
    machine_info,
    summarize,
)
from slotserve.lab.bench.targets import EngineTarget, OpenAITarget
from slotserve.lab.workload import BenchRequest, Workload, generate_workload, load_workload

__all__ = ["BenchRequest", "BenchResult", "BenchSampling", "EngineTarget",
           "LatencyStats", "OpenAITarget", "RequestRecord", "RunStats", "Workload",
           "compare_ratios", "format_detail", "format_ratios",
           "format_table", "generate_workload", "load_workload", "machine_info", "plot_knee",
           "run_bench", "summarize", "write_report"]
