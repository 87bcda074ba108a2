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
import random
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from slotserve.lab.bench.server import ServerProcess, cli_flags, scrape_metrics

TOOLS = ("slotserve bench", "aiperf", "guidellm")
METRICS = ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "gap_p50_ms", "output_tok_s")
SERVER_COUNTERS = {"slotserve:prompt_tokens_total": "prompt_tokens",
                   "slotserve:generation_tokens_total": "generation_tokens",
                   "slotserve:request_success_total": "requests_finished"}
# The server's own latency histograms (seconds): their sums and counts give its means.
SERVER_HISTOGRAMS = {"slotserve:time_to_first_token_seconds": "ttft_mean_ms",
                     "slotserve:time_per_output_token_seconds": "tpot_mean_ms",
                     "slotserve:inter_token_latency_seconds": "itl_mean_ms"}


@dataclass(frozen=True)
class Workload:
    """What every client sends (see the module docstring)."""

    requests: int = 24
    input_tokens: int = 128
    output_tokens: int = 64
    slots: int = 8
    seed: int = 0


@dataclass
class ClientResult:
    """One client's run, from its own export (milliseconds; output tokens per second)."""

    tool: str
    ok: int
    errors: int
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    itl_p50_ms: float | None  # each request's mean gap after its first token (aiperf's ITL)
    gap_p50_ms: float | None  # every gap between two tokens (None: the tool keeps no gaps)
    output_tok_s: float | None
    command: list[str]
    ttft_mean_ms: float | None = None  # the means, to set beside the server's own
    itl_mean_ms: float | None = None
    wall_s: float = 0.0
    server: dict | None = None  # what the server counted during the run (/metrics deltas)
    error_messages: list[str] | None = None


# -- the tokenizer -------------------------------------------------------------------------------


def write_hf_tokenizer(folder: Path) -> Path:
    """The embedded model's tokenizer as a Hugging Face directory `AutoTokenizer` loads.

    `Tokenizer.save` writes tokenizer.json (the `tokenizers` backend, which is HF's own
    format) and slotserve's tokenizer_meta.json; HF also wants tokenizer_config.json: the
    class, the special tokens and the chat template.
    """
    from slotserve.loader import load_model

    tokenizer = load_model().tokenizer
    if tokenizer is None:
        raise RuntimeError("the default model has no tokenizer")
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder))
    config = {"tokenizer_class": "PreTrainedTokenizerFast",
              "add_bos_token": tokenizer.add_bos_token,
              "bos_token": _token(tokenizer, tokenizer.bos_token_id),
              "eos_token": _token(tokenizer, (tokenizer.eos_token_ids or (None,))[0]),
              "chat_template": tokenizer.chat_template}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return folder


def _token(tokenizer, token_id: int | None) -> str | None:
    return None if token_id is None else tokenizer.id_to_token(token_id)


# -- slotserve bench's workload --------------------------------------------------------------


def bench_workload(path: Path, tokenizer_dir: Path, workload: Workload) -> Path:
    """`slotserve bench --workload` JSONL: the requests of `workload`, each one user message
    of `input_tokens` tokens of random vocabulary words (distinct prompts, all at t=0)."""
    from slotserve.loader.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(str(tokenizer_dir))
    words = _vocabulary_words(tokenizer)
    rng = random.Random(workload.seed)
    with path.open("w") as f:
        for _ in range(workload.requests):
            text = _text_of_length(tokenizer, words, rng, workload.input_tokens)
            line = {"messages": [{"role": "user", "content": text}],
                    "max_tokens": workload.output_tokens}
            f.write(json.dumps(line) + "\n")
    return path


def _vocabulary_words(tokenizer) -> list[str]:
    """Whole lowercase words of the vocabulary (" word": one token each)."""
    words = []
    for token_id in range(tokenizer.vocab_size):
        text = tokenizer.decode([token_id])
        if text.startswith(" ") and text[1:].isalpha() and text[1:].islower() and len(text) > 3:
            words.append(text)
    return words


def _text_of_length(tokenizer, words: list[str], rng: random.Random, length: int) -> str:
    """Random words cut to `length` tokens (re-encoding the cut text keeps the length: every
    word is one token and a space starts each)."""
    text = "".join(rng.choice(words) for _ in range(length)).strip()
    ids = tokenizer.encode(text, add_special_tokens=False)[:length]
    return tokenizer.decode(ids)


# -- running the clients -----------------------------------------------------------------------


def bench_command(url: str, workload_file: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "slotserve.cli", "bench", "--url", url, "--endpoint", "chat",
            "--workload", str(workload_file), "--out", str(out), "--no-progress"]


def aiperf_command(exe: str, url: str, model: str, tokenizer_dir: Path, workload: Workload,
                   out_dir: Path) -> list[str]:
    extra = {"ignore_eos": True, "min_tokens": workload.output_tokens, "temperature": 0}
    return [exe, "profile", "--model", model, "--url", url, "--endpoint-type", "chat",
            "--streaming", "--tokenizer", str(tokenizer_dir), "--use-server-token-count",
            "--prompt-input-tokens-mean", str(workload.input_tokens),
            "--prompt-input-tokens-stddev", "0",
            "--prompt-output-tokens-mean", str(workload.output_tokens),
            "--prompt-output-tokens-stddev", "0",
            "--extra-inputs", json.dumps(extra),
            "--concurrency", str(workload.requests), "--request-count", str(workload.requests),
            "--random-seed", str(workload.seed), "--ui-type", "none",
            "--output-artifact-dir", str(out_dir)]


def guidellm_scenario(url: str, model: str, tokenizer_dir: Path, workload: Workload,
                      out: Path) -> dict:
    """guidellm's scenario (the JSON form of its `run` options)."""
    return {
        "backend": {"kind": "openai_http", "target": url, "model": model,
                    "request_format": "/v1/chat/completions",
                    "extras": {"body": {"temperature": 0}}},
        "profile": {"kind": "concurrent", "streams": [workload.requests]},
        "constraints": [{"kind": "max_requests", "count": workload.requests}],
        "tokenizer": {"kind": "huggingface_auto", "model": str(tokenizer_dir)},
        # NOTE: no *_stdev: guidellm wants them > 0; without them every length is fixed
        "data": [{"kind": "synthetic_text", "prompt_tokens": workload.input_tokens,
                  "output_tokens": workload.output_tokens}],
        "seed": {"kind": "static", "value": workload.seed},
        "outputs": [{"kind": "json", "path": str(out)}],
    }


def guidellm_command(exe: str, scenario_file: Path) -> list[str]:
    return [exe, "run", "--scenario", str(scenario_file), "--disable-console-interactive"]


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


# -- reading the clients' exports ------------------------------------------------------------


def parse_bench(path: Path, command: list[str]) -> ClientResult:
    """`slotserve bench --out`: TPOT is the per-request mean gap, ITL every gap."""
    run = json.loads(path.read_text())["results"][0]
    return ClientResult("slotserve bench", run["completed"], run["failed"],
                        run["ttft_ms"]["p50"], run["ttft_ms"]["p99"], run["tpot_ms"]["p50"],
                        run["itl_ms"]["p50"], run["output_throughput"], command,
                        run["ttft_ms"]["mean"], run["tpot_ms"]["mean"],
                        error_messages=run["errors"] or None)


def parse_aiperf(folder: Path, command: list[str]) -> ClientResult:
    """aiperf's profile_export_aiperf.json: inter_token_latency is each request's
    (latency - TTFT) / (output tokens - 1), inter_chunk_latency every gap between chunks."""
    run = json.loads((folder / "profile_export_aiperf.json").read_text())
    ok = int(run["completed_request_count"]["avg"])
    errors = sum(int(e.get("count", 1)) for e in run.get("error_summary") or [])
    return ClientResult("aiperf", ok, errors, run["time_to_first_token"]["p50"],
                        run["time_to_first_token"]["p99"], run["inter_token_latency"]["p50"],
                        run["inter_chunk_latency"]["p50"], run["output_token_throughput"]["avg"],
                        command, run["time_to_first_token"]["avg"],
                        run["inter_token_latency"]["avg"],
                        error_messages=[str(e) for e in run.get("error_summary") or []] or None)


def parse_guidellm(path: Path, command: list[str]) -> ClientResult:
    """guidellm's JSON report (its one benchmark): inter_token_latency_ms is each request's
    (latency - TTFT) / (output tokens - 1), one sample per gap; no single gaps are kept."""
    run = json.loads(path.read_text())["benchmarks"][0]
    metrics, totals = run["metrics"], run["metrics"]["request_totals"]

    def p(name: str, q: str) -> float:
        return metrics[name]["successful"]["percentiles"][q]

    def mean(name: str) -> float:
        return metrics[name]["successful"]["mean"]

    errored = [r.get("info", {}).get("error") for r in run["requests"].get("errored") or []]
    return ClientResult("guidellm", totals["successful"],
                        totals["errored"] + totals["incomplete"],
                        p("time_to_first_token_ms", "p50"), p("time_to_first_token_ms", "p99"),
                        p("inter_token_latency_ms", "p50"), None,
                        metrics["output_tokens_per_second"]["successful"]["mean"], command,
                        mean("time_to_first_token_ms"), mean("inter_token_latency_ms"),
                        error_messages=[str(e) for e in errored] or None)


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
