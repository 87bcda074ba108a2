"""Third-party clients against `slotserve serve` (issue 20): NVIDIA's aiperf, guidellm
(vllm-project) and `slotserve bench`, one server, one workload, side by side.

    PYTHONPATH=src nice -n 19 python -m benchmarks.clients --rounds 3 \\
        --out benchmarks/results/clients.json  # --aiperf / --guidellm: where the clients are

The clients live in their own virtual environments (they pin their own transformers, pydantic
and aiohttp), never slotserve's:

    for tool in aiperf guidellm; do python3 -m venv /tmp/clients/$tool &&
        /tmp/clients/$tool/bin/pip install torch==2.13.0 && /tmp/clients/$tool/bin/pip install $tool
    done

(torch first: its CPU build; otherwise pip pulls CUDA's.) Both need the model's tokenizer as a
Hugging Face directory: `write_hf_tokenizer` writes the embedded model's (`Tokenizer.save`'s
tokenizer.json plus a tokenizer_config.json naming its special tokens and chat template).

The workload, the same for every client: `--requests` streaming chat requests (one user
message of `--input-tokens` tokens of synthetic text, each client's own generator), exactly
`--output-tokens` output tokens (ignore_eos; greedy), all sent at once (each client's
concurrency = the request count), to a server with `--slots` slots (max_num_seqs) and prefix
caching off (the clients' prompts share no prefix, and a rerun of the same prompts must not
hit the cache). `slotserve bench` has no closed-loop concurrency, hence "all at once" for
every client: the server's slots, not the clients, bound what runs together. The server's
own counters (/metrics: prompt and generation tokens, requests finished, and its TTFT and
TPOT histograms) are read before and after each client: what each one actually sent, and
the server's own mean TTFT / TPOT of those requests, against which each client's means are
set (client / server: free of the host's drift between runs). 24 requests on 8 slots run in
three waves, so TTFT p50 falls inside the middle wave, not on a wave's edge.

The clients run one after another against one server (after a short warm-up run), in the
order given; `--rounds N` repeats them, reversing the order every other round. Each
client's own export is parsed (aiperf: profile_export_aiperf.json; guidellm: its JSON
report; slotserve bench: --out JSON) for: requests ok / errors, TTFT p50 / p99, ITL p50,
gap p50, output tok/s, and their ratios to slotserve bench. The definitions, as each tool
computes them:
- TTFT: request sent -> first chunk with text (all three; slotserve sends the role chunk
  with the first token, so no client sees an early empty chunk).
- ITL: each request's (latency - TTFT) / (output tokens - 1), the first token excluded:
  aiperf's inter_token_latency, guidellm's inter_token_latency_ms (one sample per gap, so
  token-weighted; equal lengths here), slotserve bench's TPOT. Not guidellm's "TPOT",
  which is latency / output tokens (TTFT included).
- gap: every gap between two text chunks: aiperf's inter_chunk_latency, slotserve bench's
  ITL; guidellm keeps no single gaps.
- output tok/s: output tokens / the run's span (first request sent -> last answer).
aiperf is told --use-server-token-count: its token counts come from the server's usage,
as slotserve bench's do (by default it re-tokenizes the answer text, which drops the EOS
tokens that ignore_eos lets through and skip_special_tokens hides).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from benchmarks.clients_tools import (
    METRICS,
    TOOLS,
    ClientResult,
    Workload,
    aiperf_command,
    bench_command,
    bench_workload,
    guidellm_command,
    guidellm_scenario,
    parse_aiperf,
    parse_bench,
    parse_guidellm,
    write_hf_tokenizer,
)
from slotserve.lab.bench.server import ServerProcess, cli_flags, scrape_metrics

# NOTE: each client's command and export parser, the workload and the tokenizer directory:
# benchmarks/clients_tools.py (importable from here too).
__all__ = ["ClientResult", "Workload", "bench_workload", "median_over_rounds", "parse_aiperf",
           "parse_guidellm", "ratios", "write_hf_tokenizer"]

SERVER_COUNTERS = {"slotserve:prompt_tokens_total": "prompt_tokens",
                   "slotserve:generation_tokens_total": "generation_tokens",
                   "slotserve:request_success_total": "requests_finished"}
# The server's own latency histograms (seconds): their sums and counts give its means.
SERVER_HISTOGRAMS = {"slotserve:time_to_first_token_seconds": "ttft_mean_ms",
                     "slotserve:time_per_output_token_seconds": "tpot_mean_ms",
                     "slotserve:inter_token_latency_seconds": "itl_mean_ms"}


def run_logged(command: list[str], log: Path, timeout: float) -> float:
    """Run `command` (stdout and stderr to `log`); its wall time. RuntimeError if it fails."""
    start = time.perf_counter()
    with log.open("wb") as f:
        done = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT, timeout=timeout,
                              check=False)
    if done.returncode != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{command[0]} exited with {done.returncode}:\n{tail}")
    return time.perf_counter() - start


def server_counts(url: str) -> dict[str, float]:
    """The server's token and request counters and its latency histograms' sums and counts
    (each summed over its labels)."""
    samples = scrape_metrics(url)
    names = [*SERVER_COUNTERS, *(h + "_sum" for h in SERVER_HISTOGRAMS),
             *(h + "_count" for h in SERVER_HISTOGRAMS)]
    return {name: sum(v for k, v in samples.items() if k.split("{")[0] == name)
            for name in names}


def counted_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What the server counted between two `server_counts`: tokens, requests, and its
    mean TTFT / TPOT / ITL over the requests finished meanwhile (milliseconds)."""
    out: dict[str, float] = {short: int(after[name] - before[name])
                             for name, short in SERVER_COUNTERS.items()}
    for name, short in SERVER_HISTOGRAMS.items():
        count = after[name + "_count"] - before[name + "_count"]
        total = after[name + "_sum"] - before[name + "_sum"]
        out[short] = round(1000.0 * total / count, 1) if count else None
    return out


# -- the run ---------------------------------------------------------------------------------


CLIENT_FIELDS = set(ClientResult.__dataclass_fields__)


@dataclass
class Setup:
    """Where everything goes and what runs: the server, the tokenizer, the client binaries."""

    url: str
    model: str
    tokenizer_dir: Path
    work: Path
    workload: Workload
    aiperf: str
    guidellm: str
    timeout: float


def run_client(tool: str, setup: Setup, tag: str) -> ClientResult:
    """Run one client against the server; its result, with the server's counts meanwhile."""
    folder = setup.work / f"{tag}-{tool.replace(' ', '-')}"
    shutil.rmtree(folder, ignore_errors=True)  # NOTE: never parse an earlier run's export
    folder.mkdir(parents=True)
    if tool == "slotserve bench":
        workload_file = bench_workload(folder / "workload.jsonl", setup.tokenizer_dir,
                                       setup.workload)
        command = bench_command(setup.url, workload_file, folder / "bench.json")
        parse = lambda: parse_bench(folder / "bench.json", command)  # noqa: E731
    elif tool == "aiperf":
        command = aiperf_command(setup.aiperf, setup.url, setup.model, setup.tokenizer_dir,
                                 setup.workload, folder / "artifacts")
        parse = lambda: parse_aiperf(folder / "artifacts", command)  # noqa: E731
    elif tool == "guidellm":
        scenario = guidellm_scenario(setup.url, setup.model, setup.tokenizer_dir,
                                     setup.workload, folder / "guidellm.json")
        scenario_file = folder / "scenario.json"
        scenario_file.write_text(json.dumps({"spec": scenario}, indent=1))
        command = guidellm_command(setup.guidellm, scenario_file)
        parse = lambda: parse_guidellm(folder / "guidellm.json", command)  # noqa: E731
    else:
        raise ValueError(f"unknown client {tool!r}: one of {', '.join(TOOLS)}")
    before = server_counts(setup.url)
    wall = run_logged(command, folder / "client.log", setup.timeout)
    result = parse()
    result.wall_s = wall
    result.server = counted_delta(before, server_counts(setup.url))
    return result


def ratios(result: ClientResult, baseline: ClientResult) -> dict[str, float | None]:
    """result / slotserve bench, metric by metric."""
    out = {}
    for name in METRICS:
        a, b = getattr(baseline, name), getattr(result, name)
        out[name] = None if a in (None, 0) or b is None else b / a
    return out


def server_ratios(result: ClientResult) -> dict[str, float | None]:
    """The client's means over the server's own for the same requests (drift-free: both
    measured the same run): mean TTFT, and mean ITL (each request's mean gap) over the
    server's mean TPOT (the same definition)."""
    server = result.server or {}

    def over(a: float | None, b: float | None) -> float | None:
        return None if a is None or not b else a / b

    return {"ttft": over(result.ttft_mean_ms, server.get("ttft_mean_ms")),
            "itl": over(result.itl_mean_ms, server.get("tpot_mean_ms"))}


def table(results: list[ClientResult]) -> str:
    """The side-by-side table (markdown), ratios to the same round's slotserve bench."""
    head = ("| tool | ok / errors | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | gap p50 ms "
            "| output tok/s | server: TTFT / TPOT mean ms |\n"
            "| --- | --- | --- | --- | --- | --- | --- | --- |")
    rows = [head]
    for r in results:
        server = r.server or {}
        rows.append(f"| {r.tool} | {r.ok} / {r.errors} | "
                    + " | ".join(_fmt(getattr(r, m)) for m in METRICS)
                    + f" | {_fmt(server.get('ttft_mean_ms'), '{:.0f}')} / "
                      f"{_fmt(server.get('tpot_mean_ms'), '{:.0f}')} |")
    return "\n".join(rows)


def ratio_table(results: list[ClientResult]) -> str:
    """Ratios to slotserve bench, and each client's own figures over the server's."""
    rows = ["| tool / slotserve bench | TTFT p50 | TTFT p99 | ITL p50 | gap p50 | output tok/s "
            "| client / server means: TTFT, ITL |", "| --- | --- | --- | --- | --- | --- | --- |"]
    baseline = _bench(results)
    for r in results:
        own = " | ".join(_fmt(v, "x{:.2f}") for v in ratios(r, baseline).values())
        if r is baseline:
            own = " | ".join(["-"] * len(METRICS))
        vs_server = ", ".join(_fmt(v, "x{:.2f}") for v in server_ratios(r).values())
        rows.append(f"| {r.tool} | {own} | {vs_server} |")
    return "\n".join(rows)


def _fmt(value: float | None, pattern: str = "{:.1f}") -> str:
    return "-" if value is None else pattern.format(value)


def median_over_rounds(rounds: list[list[ClientResult]]) -> list[ClientResult]:
    """Each tool's median of every metric over the rounds (counts summed)."""
    out = []
    for tool in [r.tool for r in rounds[0]]:
        runs = [r for results in rounds for r in results if r.tool == tool]
        medians = {m: _median([getattr(r, m) for r in runs]) for m in METRICS}
        server = {k: _median([(r.server or {}).get(k) for r in runs])
                  for k in ("ttft_mean_ms", "tpot_mean_ms")}
        means = {m: _median([getattr(r, m) for r in runs])
                 for m in ("ttft_mean_ms", "itl_mean_ms")}
        out.append(ClientResult(tool, sum(r.ok for r in runs), sum(r.errors for r in runs),
                                **medians, command=runs[0].command, server=server, **means))
    return out


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def run_rounds(setup: Setup, tools: list[str], rounds: int) -> list[list[ClientResult]]:
    """Each round runs every tool once; the order reverses every other round."""
    out = []
    for index in range(rounds):
        order = tools if index % 2 == 0 else tools[::-1]
        results = []
        for tool in order:
            print(f"round {index + 1}: {tool} ...", flush=True)
            results.append(run_client(tool, setup, f"r{index + 1}"))
            print(table(results[-1:]).splitlines()[-1], flush=True)
        out.append(results)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    w = Workload()
    p.add_argument("--aiperf", default="/tmp/clients/aiperf/bin/aiperf")
    p.add_argument("--guidellm", default="/tmp/clients/guidellm/bin/guidellm")
    p.add_argument("--tools", default=",".join(TOOLS), help="comma-separated, in this order")
    p.add_argument("--requests", type=int, default=w.requests)
    p.add_argument("--input-tokens", type=int, default=w.input_tokens)
    p.add_argument("--output-tokens", type=int, default=w.output_tokens)
    p.add_argument("--slots", type=int, default=w.slots, help="the server's max_num_seqs")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/clients/run"),
                   help="the tokenizer, each client's exports and logs, the server's log")
    p.add_argument("--timeout", type=float, default=900.0, help="per client run (s)")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    p.add_argument("--render", type=Path, default=None, metavar="RESULTS.json",
                   help="run nothing: print the tables of a results file and rewrite its "
                        "derived fields (ratios, medians)")
    args = p.parse_args(argv)
    if args.render:
        report = json.loads(args.render.read_text())
        rounds = [[ClientResult(**{k: v for k, v in r.items() if k in CLIENT_FIELDS})
                   for r in results] for results in report["rounds"]]
        write_report(report, rounds, args.render)
        return
    tools = args.tools.split(",")
    if "slotserve bench" not in tools or not set(tools) <= set(TOOLS):
        p.error(f"--tools: some of {', '.join(TOOLS)}, slotserve bench among them")
    workload = Workload(args.requests, args.input_tokens, args.output_tokens, args.slots)
    flags = [*cli_flags(max_num_seqs=workload.slots), "--no-enable-prefix-caching"]
    rounds, load = run_all(args, tools, workload, flags)
    report = {"workload": asdict(workload), "server_flags": flags,
              "command": "python -m benchmarks.clients " + " ".join(argv or sys.argv[1:]),
              "versions": tool_versions(args.aiperf, args.guidellm), "load_average": load}
    write_report(report, rounds, args.out)


def run_all(args, tools: list[str], workload: Workload,
            flags: list[str]) -> tuple[list[list[ClientResult]], dict]:
    """Start the server, warm it up, run the rounds; the results and the load averages."""
    args.work_dir.mkdir(parents=True, exist_ok=True)
    tokenizer_dir = write_hf_tokenizer(args.work_dir / "tokenizer")
    server = ServerProcess.launch(args.work_dir / "server.log", *flags)
    try:
        server.wait_ready()
        model = json.loads(_get(server.url + "/v1/models"))["data"][0]["id"]
        setup = Setup(server.url, model, tokenizer_dir, args.work_dir, workload, args.aiperf,
                      args.guidellm, args.timeout)
        warm = replace(setup, workload=Workload(workload.slots, workload.input_tokens, 8,
                                                workload.slots, seed=1))
        run_client("slotserve bench", warm, "warmup")  # first requests: allocator, caches
        load_before = os.getloadavg()
        rounds = run_rounds(setup, tools, args.rounds)
        load_after = os.getloadavg()
    finally:
        server.stop()
    return rounds, {"before": load_before, "after": load_after}


def write_report(report: dict, rounds: list[list[ClientResult]], out: Path | None) -> None:
    """Print the tables; with `out`, write `report` with the rounds and what derives from
    them (ratios to slotserve bench, client / server, medians over rounds)."""
    for index, results in enumerate(rounds):
        print(f"\nround {index + 1}\n{table(results)}\n\n{ratio_table(results)}")
    report["rounds"] = [[_entry(r, results) for r in results] for results in rounds]
    if len(rounds) > 1:
        medians = median_over_rounds(rounds)
        print(f"\nmedian of {len(rounds)} rounds\n{table(medians)}\n\n{ratio_table(medians)}")
        report["median_over_rounds"] = [_entry(r, medians) for r in medians]
    print(f"\nload average (1, 5, 15 min): {report['load_average']}")
    if out:
        out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {out}")


def _entry(result: ClientResult, results: list[ClientResult]) -> dict:
    return {**asdict(result), "ratios_to_bench": ratios(result, _bench(results)),
            "over_server": server_ratios(result)}


def _bench(results: list[ClientResult]) -> ClientResult:
    return next(r for r in results if r.tool == "slotserve bench")


def _get(url: str) -> str:
    import httpx

    return httpx.get(url, timeout=10).text


def tool_versions(aiperf: str, guidellm: str) -> dict[str, str]:
    """The clients' and their main dependencies' versions (pip, in each one's venv)."""
    out = {}
    for exe, names in ((aiperf, ("aiperf", "transformers", "torch")),
                       (guidellm, ("guidellm", "transformers", "torch"))):
        python = str(Path(exe).with_name("python"))
        code = ("import importlib.metadata as m, json; print(json.dumps({n: m.version(n) for n "
                f"in {list(names)!r}}}))")
        found = json.loads(subprocess.run([python, "-c", code], capture_output=True, text=True,
                                          check=True).stdout)
        out.update({f"{names[0]}/{k}" if k != names[0] else k: v for k, v in found.items()})
    return out


if __name__ == "__main__":
    main()
