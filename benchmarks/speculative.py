"""Speculative decoding on against off: output tok/s and TPOT, interleaved, per batch size,
on workload W and online.

    PYTHONPATH=src python -m benchmarks.speculative --rounds 2 --fixed 4 --out

One engine per setting in process (the embedded SmolLM2-135M unless --model; the weights
loaded once): speculation off, `--speculative-config` "auto" (default: ngram,
prompt_lookup 2..5) and, with `--fixed K`, the same method at a fixed K drafts. Two
workloads of greedy chat requests: `grounded` (answers that copy from their input: a code
edit that repeats most of a function, fields extracted verbatim from a given text, a passage
quoted back) and `free` (open questions, little to copy). Three kinds of cell, every round
running each setting once in an order that rotates round by round (a drift of the host's
speed falls on every side):

- batch (`--batches`, default 1 4 16 64): a run sends the workload's prompts in groups of
  that many requests at once, one group after another, every prompt at least once
  (`cell_groups`: batch 1 is the four prompts alone in turn, 4 one group of the four, 16
  and 64 one group cycling through them), max_num_seqs 64, `--max-tokens` each. Per run:
  output tokens / wall time over the groups, TPOT p50 / p99 over the completions, and
  whether the tokens equal the off run's (greedy: they must, up to the near-tie rule of
  docs/ARCHITECTURE.md); with several groups also the first group's ratio alone (what a
  batch-1 cell measured before 2026-12-05: the first prompt only).
- W (`benchmarks/perf.py`'s `workload_w`: 64 chat requests at t=0, lognormal output
  lengths, ignore_eos; `--no-w` skips it) at 64 slots.
- online (`--online RATE...`, default 2 4 req/s; `--online` alone: none):
  `--online-requests` requests of each workload (the prompts in turn, `--max-tokens`,
  greedy, stopping at EOS) at Poisson arrivals (one schedule for every setting), 64 slots.

W and online run through `slotserve.lab.bench.run_bench` on a fresh engine per run that has
answered one short warm-up request first (TTFT, TPOT p50/p99, output tok/s as
`benchmarks/perf.py` reports them). Per cell the summary gives each on setting's median
over rounds of on / off: output tok/s and TPOT p99 (issue 35's targets: W and the 64-slot
cells >= 0.97x tok/s, TPOT p99 no worse than off).

The replay's prediction (issue 35: within 15% of the measured ratio; `--no-replay` skips
it), for the batch cells and W: per cell and round, the off run's trace is replayed
(`slotserve.lab.replay`, no model) with speculation off and with the setting's config,
drafts offered and accepted where that round's on run recorded them (per request and
output position: the replay's DraftOracle; how many to verify its own speculator decides, on
the replay's clock). Predicted ratio: replayed on tok/s / replayed off tok/s, median over
the rounds; its error against the measured median. The clock (`--clock`): `knee` (default),
a `LinearCost` with a knee over rows (`LinearCost.fit(knee="auto")`: a step of few rows
reads the weights once, so rows are nearly free until the step turns compute-bound), fit on
every iteration of this benchmark's off runs (their trace times: the machine, model and
kernels measured, no extra run); `linear`: the same fit without the knee; or `--profile
PROFILE.json` (a `slotserve calibrate` profile). NOTE: the fit tells a row's cost from an
iteration's fixed cost only across batch sizes (a verification's drafts are decode rows);
with one `--batches` value and no W, use --profile. Unless `--no-anchor` (the clock before
2026-12-05): each off run has a base of its own in the fit (a workload's cost per step that
no feature sees: grounded batch 1 decoded at ~8 ms a step where the fit priced ~6.3), each
cell's prediction moves the base to that round's off run's decodes (`anchored`), and the
attention of a verification's drafted rows (they re-read the KV its first row just read) is
priced on the other cells' runs with drafts (`with_draft_pairs`), never the cell's own.

`--control` also runs speculation off on a second engine (`off2`, interleaved like the
others): off2 / off is what each figure moves between two runs of the same thing, the yardstick
for a ratio near 1 (a batch cell's TPOT p99 is its slowest few completions' TPOT).

`--save-traces PATH` writes the measurements and every run's trace (gzip JSON, several MB);
`--from-traces PATH` predicts again from such a file without running the model (e.g.
another `--clock`). `--out [PATH]` writes the JSON report (default:
benchmarks/results/speculative.json). NOTE: the lead runs it on a quiet machine; a loaded
2-core box swings tok/s several-fold.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import statistics
import sys
import time

from benchmarks.perf import workload_w
from slotserve import SamplingParams
from slotserve.engine.async_engine import freeze_heap
from slotserve.engine.llm import LLM
from slotserve.lab.bench import BenchSampling, EngineTarget, run_bench
from slotserve.lab.bench.report import write_report
from slotserve.lab.replay.cost_model import DRAFT_PAIRS, load_profile
from slotserve.lab.replay.spec_prediction import fit_trace_cost, predict_ratio, with_draft_pairs
from slotserve.lab.workload import BenchRequest, Workload, with_poisson_arrivals
from slotserve.percentile import percentile

DEFAULT_OUT = "benchmarks/results/speculative.json"
PREDICTION_BOUND = 0.15  # issue 35: the replay predicts the on/off ratio within 15%
NO_LOSS = 0.97  # issue 35: W and the 64-slot cells keep at least this share of off's tok/s
W_SLOTS = 64
CONTROL = "off2"  # --control's second engine with speculation off
ONLINE_RATES = (2.0, 4.0)
ONLINE_REQUESTS = 32
# A warm-up prompt of token ids: no chat template, so it leaves no cached prefix that the
# measured chat prompts would hit.
WARM_PROMPT = list(range(5, 21))
CODE = '''def parse_config(path):
    """Read a key=value file into a dict, skipping comments and blank lines."""
    result = {}
    with open(path) as handle:
        for line in handle:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, _, value = line.partition("=")
            result[key.strip()] = value.strip()
    return result
'''
RECORD = ("Order 48213 was placed by Maria Keller on 12 March 2024 for three boxes of "
          "blue ceramic tiles, to be delivered to 14 Linden Street, Hamburg. The invoice "
          "total is 412.50 EUR and payment is due within 30 days.")
PASSAGE = ("The river rises in the northern hills and runs south for two hundred "
           "kilometres before it reaches the sea. Its valley was settled early, and the "
           "old mills along its banks still stand, though none of them has turned a wheel "
           "in a hundred years.")
GROUNDED = (
    f"Rename the variable `result` to `settings` in this function and return the whole "
    f"function:\n\n{CODE}",
    f"Copy the customer name, the address and the invoice total exactly as written in "
    f"this text, one per line:\n\n{RECORD}",
    f"Quote the following passage word for word, then stop:\n\n{PASSAGE}",
    f"Add a docstring line saying the file must exist, and return the whole function:"
    f"\n\n{CODE}",
)
FREE = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are three good reasons to learn a second language? Explain each briefly.",
    "Describe a perfect autumn day in a small mountain town.",
    "Give some advice to someone starting their first job as a programmer.",
)
WORKLOADS = {"grounded": GROUNDED, "free": FREE}


def chat_prompts(llm: LLM, texts: tuple[str, ...], count: int) -> list[list[int]]:
    return [llm.tokenizer.encode_chat([{"role": "user", "content": texts[i % len(texts)]}],
                                      add_generation_prompt=True) for i in range(count)]


def run_once(llm: LLM, prompts: list[list[int]], max_tokens: int) -> dict:
    """One batch sent at once: tokens, wall time, tok/s, TPOT p50/p99 (and each
    completion's TPOT in s, `tpots`), the token ids and the run's iteration trace
    (`trace`: for the replay; not written to the report)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    spec = llm.engine.scheduler.speculator
    before = (spec.num_draft_tokens, spec.num_accepted_tokens) if spec else (0, 0)
    llm.engine.trace.clear()  # NOTE: the trace of this run only
    freeze_before_run()
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    trace = llm.engine.export_trace()
    completions = [o.outputs[0] for o in outputs]
    tokens = sum(len(c.token_ids) for c in completions)
    tpots = [c.metrics.tpot for c in completions if c.metrics and c.metrics.tpot is not None]
    drafted = (spec.num_draft_tokens - before[0], spec.num_accepted_tokens - before[1]) \
        if spec else (0, 0)
    return {"output_tokens": tokens, "seconds": seconds, "output_tok_s": tokens / seconds,
            "tpot_p50_ms": 1000 * percentile(tpots, 50) if tpots else None,
            "tpot_p99_ms": 1000 * percentile(tpots, 99) if tpots else None,
            "draft_tokens": drafted[0], "accepted_tokens": drafted[1],
            "token_ids": [list(c.token_ids) for c in completions], "trace": trace,
            "tpots": tpots}


def cell_groups(prompts: list[list[int]], batch: int) -> list[list[list[int]]]:
    """The groups of prompts a batch cell sends, one group after another, each group's
    requests at once: every prompt of the workload at least once, `batch` at a time, cycling
    through them. batch >= len(prompts): one group of `batch` (the prompts in turn); fewer:
    ceil(len(prompts) / batch) groups (batch 1: each prompt alone, in turn).

    NOTE: before 2026-12-05 a cell sent one group of `batch` prompts, so batch 1 measured
    only the workload's first prompt.
    """
    if not prompts or batch < 1:
        raise ValueError(f"cell_groups: need prompts and batch >= 1, got {len(prompts)} "
                         f"prompts and batch {batch}")
    count = max(1, math.ceil(len(prompts) / batch))
    return [[prompts[(group * batch + i) % len(prompts)] for i in range(batch)]
            for group in range(count)]


def run_groups(llm: LLM, groups: list[list[list[int]]], max_tokens: int) -> dict:
    """`run_once` on each group in turn, summed: output tokens / seconds over all groups,
    TPOT p50/p99 over every completion, each group's own figures (`groups`), the token ids
    in group order and the groups' traces (`trace`: a list, one per group)."""
    parts = [run_once(llm, group, max_tokens) for group in groups]
    tokens = sum(p["output_tokens"] for p in parts)
    seconds = sum(p["seconds"] for p in parts)
    tpots = [t for p in parts for t in p.pop("tpots")]
    return {"output_tokens": tokens, "seconds": seconds, "output_tok_s": tokens / seconds,
            "tpot_p50_ms": 1000 * percentile(tpots, 50) if tpots else None,
            "tpot_p99_ms": 1000 * percentile(tpots, 99) if tpots else None,
            "draft_tokens": sum(p["draft_tokens"] for p in parts),
            "accepted_tokens": sum(p["accepted_tokens"] for p in parts),
            "groups": [{k: p[k] for k in ("output_tokens", "seconds", "output_tok_s",
                                          "draft_tokens", "accepted_tokens")} for p in parts],
            "token_ids": [ids for p in parts for ids in p["token_ids"]],
            "trace": [p["trace"] for p in parts]}


def run_cell(engines: dict[str, LLM], prompts: list[list[int]], max_tokens: int,
             rounds: int, log, traces: dict[str, list[list[dict]]] | None = None,
             batch: int | None = None) -> dict:
    """`rounds` runs of every setting on one workload and batch size, order rotating; a
    run sends the prompts in `cell_groups` of `batch` (None: all at once, one group).

    traces: filled with each setting's runs' traces, in round order, each run's a list
    (one trace per group; for the replay)."""
    groups = cell_groups(prompts, batch or len(prompts))
    names = list(engines)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for number in range(rounds):
        for name in _rotated(names, number):
            result = run_groups(engines[name], groups, max_tokens)
            runs[name].append(result)
            log(f"  round {number + 1} {name}: {result['output_tok_s']:.1f} tok/s, TPOT p99 "
                f"{result['tpot_p99_ms'] or 0:.1f} ms, drafts {result['draft_tokens']} "
                f"accepted {result['accepted_tokens']}")
    reference = runs["off"][0]["token_ids"]
    same = {name: all(r["token_ids"] == reference for r in runs[name]) for name in names}
    for name in names:
        recorded = [r.pop("trace") for r in runs[name]]
        if traces is not None:
            traces[name] = recorded
        for r in runs[name]:
            r.pop("token_ids")
    cell = compare_runs(runs)
    for name in names:
        cell[name]["identical_to_off"] = same[name]
        if len(groups) > 1 and name != "off":
            cell[name]["first_group_ratio"] = statistics.median(
                on["groups"][0]["output_tok_s"] / off["groups"][0]["output_tok_s"]
                for on, off in zip(runs[name], runs["off"]))
    return cell


def _rotated(names: list[str], number: int) -> list[str]:
    """Round `number`'s order: the settings rotated by the round's number."""
    shift = number % len(names)
    return names[shift:] + names[:shift]


def compare_runs(runs: dict[str, list[dict]]) -> dict:
    """Per setting its runs; per on setting the median over rounds of on / off: output tok/s
    (`median_ratio`), TPOT p50 and p99 (`tpot_p50_ratio`, `tpot_p99_ratio`: None where a
    round has no TPOT)."""
    cell = {}
    for name, own in runs.items():
        cell[name] = {"runs": own}
        if name != "off":
            cell[name]["median_ratio"] = _median_ratio(own, runs["off"], "output_tok_s")
            cell[name]["tpot_p50_ratio"] = _median_ratio(own, runs["off"], "tpot_p50_ms")
            cell[name]["tpot_p99_ratio"] = _median_ratio(own, runs["off"], "tpot_p99_ms")
    return cell


def _median_ratio(on: list[dict], off: list[dict], key: str) -> float | None:
    ratios = [a[key] / b[key] for a, b in zip(on, off) if a.get(key) and b.get(key)]
    return statistics.median(ratios) if ratios else None


def freeze_before_run() -> None:
    """Collect and freeze what is alive before a measured run, as the server does after its
    start-up (`freeze_heap`: `gc.collect(); gc.freeze()`).

    NOTE: unfrozen, a full collection scans every object alive, here three engines and
    the tokenizer: 43-67 ms with the three engines built (211-232k objects, a loaded host),
    against 5-30 ms steps, and one came in a 64-request run with speculation (a probe: none
    in off's, none with one engine). The server does not pay them (its heap is frozen), so
    the benchmark does not either. The ~330 ms stalls in the 2026-12-04 traces (one every
    ~45 steps at 64 sequences, off and on alike) are 5x such a collection and more
    frequent: collections on a host loaded several-fold may be part of them; not pinned.
    """
    freeze_heap()


# ----------------------------------------------------------------------- W and online
class WarmedTarget(EngineTarget):
    """`run_bench`'s in-process target (a fresh engine per run) whose engine answers one
    short request before the run, so a first forward's one-off costs fall outside it. It
    keeps the last engine it built (`last_engine`: its trace and speculation counts) and
    those counts after the warm-up (`warm_counts`)."""

    last_engine = None
    warm_counts = (0, 0)

    def configured(self, **overrides) -> WarmedTarget:
        return WarmedTarget(self.model_config, self.weights, self.tokenizer,
                            {**self.engine_kwargs, **overrides}, self.source)

    def build(self):
        engine = super().build()
        engine.add_request("warm-up", WARM_PROMPT,
                           SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0))
        while engine.has_unfinished_requests():
            engine.step()
        engine.trace.clear()
        self.last_engine, self.warm_counts = engine, spec_counts(engine)
        freeze_before_run()
        return engine


def spec_counts(engine) -> tuple[int, int]:
    """(draft tokens proposed, accepted) by an engine's speculator so far ((0, 0): off)."""
    spec = engine.scheduler.speculator
    return (spec.num_draft_tokens, spec.num_accepted_tokens) if spec else (0, 0)


def online_workload(texts: tuple[str, ...], count: int, rate: float, max_tokens: int,
                    seed: int = 0) -> Workload:
    """`count` chat requests of the texts in turn, `max_tokens` each, at Poisson arrivals of
    `rate` req/s (the same schedule for every setting: one seed)."""
    requests = tuple(BenchRequest(id=str(i), max_tokens=max_tokens,
                                  messages=[{"role": "user", "content": texts[i % len(texts)]}])
                     for i in range(count))
    return with_poisson_arrivals(Workload(requests, {"source": "benchmarks.speculative"}),
                                 rate, seed)


def run_bench_cell(targets: dict[str, WarmedTarget], workload: Workload,
                   sampling: BenchSampling, rounds: int, log,
                   traces: dict[str, list[dict]] | None = None) -> dict:
    """`rounds` runs of every setting through `run_bench` (a fresh warmed engine each),
    order rotating: per run output tok/s, TPOT and TTFT p50/p99, failures and drafts; per on
    setting the median ratios (`compare_runs`). traces: filled with each setting's run
    traces, in round order (for the replay)."""
    names = list(targets)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    recorded: dict[str, list[dict]] = {name: [] for name in names}
    for number in range(rounds):
        for name in _rotated(names, number):
            target = targets[name]
            result = run_bench(workload, target, sampling=sampling, label=name)
            engine, target.last_engine = target.last_engine, None
            drafts, accepted = (now - warm for now, warm in
                                zip(spec_counts(engine), target.warm_counts))
            run = {"output_tokens": result.total_output_tokens, "seconds": result.duration_s,
                   "output_tok_s": result.output_throughput, "completed": result.completed,
                   "failed": result.failed, "tpot_p50_ms": result.tpot_ms.p50,
                   "tpot_p99_ms": result.tpot_ms.p99, "ttft_p50_ms": result.ttft_ms.p50,
                   "ttft_p99_ms": result.ttft_ms.p99, "draft_tokens": drafts,
                   "accepted_tokens": accepted}
            runs[name].append(run)
            if traces is not None:
                recorded[name].append(engine.export_trace())
            del engine  # NOTE: its KV pool goes before the next run's engine is built
            log(f"  round {number + 1} {name}: {run['output_tok_s']:.1f} tok/s, TPOT p50/p99 "
                f"{run['tpot_p50_ms'] or 0:.1f}/{run['tpot_p99_ms'] or 0:.1f} ms, failed "
                f"{run['failed']}, drafts {drafts} accepted {accepted}")
    if traces is not None:
        traces.update(recorded)
    return compare_runs(runs)


# ----------------------------------------------------------------------- the replay
def replay_cost_model(profile, traces: dict, log, clock: str = "knee", anchor: bool = True):
    """The replay's clock and what it is: the profile (a LinearCost) if given, else a fit
    on every off run's iterations, with a knee over rows (`clock` "knee") or without
    ("linear"); with anchor each run has a base of its own (`fit_trace_cost`'s
    per_run_base: `add_predictions` moves it to the cell's off run)."""
    if profile is not None:
        return profile, "profile"
    off = [t for cells in traces.values() for cell in cells.values() for run in cell["off"]
           for t in group_traces(run)]
    model = fit_trace_cost(off, meta={"runs": len(off)},
                           knee="auto" if clock == "knee" else None,
                           per_run_base=anchor)
    fit = model.meta["fit"]
    knee = f", knee at {model.knee:g} rows" if model.knee is not None else ", no knee"
    log(f"replay clock: fit on {len(off)} off runs' {fit['samples']} iterations{knee}, "
        f"median error {fit['median_rel_error']:.1%}, total {fit['total_rel_error']:.1%}")
    return model, f"{clock} fit on the off runs' iterations"


def cell_clock(cost_model, traces: dict, cell: tuple[str, str], log=None):
    """The clock for one cell's predictions: `cost_model` with the drafted rows' attention
    priced on the other cells' runs with drafts (`with_draft_pairs`: never the cell's own,
    whose ratio it predicts); as it is if they have too few verifications."""
    others = [t for workload, cells in traces.items() for batch, runs in cells.items()
              if (workload, batch) != cell for name, recorded in runs.items()
              if name != "off" for run in recorded for t in group_traces(run)]
    try:
        return with_draft_pairs(cost_model, others)
    except ValueError as exc:
        if log is not None:
            log(f"replay: {cell[0]} {cell[1]}: drafted rows at the attention price ({exc})")
        return cost_model


def add_predictions(report: dict, traces: dict, cost_model, anchor: bool = True,
                    log=None) -> None:
    """Each on setting's predicted ratio per cell (median over rounds of `predict_ratio` on
    that round's off and on traces) and its relative error against the measured median;
    beside it the replayed off tok/s against the measured (how well the clock fits).

    anchor: the drafted rows priced on the other cells (`cell_clock`) and the fixed cost
    moved to each round's off run (`predict_ratio`'s anchor); False: `cost_model` as it is
    (the clock before)."""
    for workload, cells in report["results"].items():
        for batch, cell in cells.items():
            clock = cell_clock(cost_model, traces, (workload, batch), log) if anchor \
                else cost_model
            measured_off = statistics.median(r["output_tok_s"] for r in cell["off"]["runs"])
            for name, config in report["settings"].items():
                if config is None:
                    continue
                rounds = [predict_run(off, on, config, clock, anchor) for off, on in
                          zip(traces[workload][batch]["off"], traces[workload][batch][name])]
                predicted = statistics.median(r["ratio"] for r in rounds)
                off_tok_s = statistics.median(r["off_tok_s"] for r in rounds)
                cell[name]["replay"] = {
                    "predicted_ratio": predicted,
                    "error": predicted / cell[name]["median_ratio"] - 1,
                    "off_tok_s": off_tok_s, "off_error": off_tok_s / measured_off - 1,
                    "draft_pairs_s": clock.coefficients.get(DRAFT_PAIRS)
                    if hasattr(clock, "coefficients") else None,
                    "rounds": rounds}


def group_traces(run) -> list[dict]:
    """A run's traces: a batch cell's run recorded one per group (a list); W, online and
    files saved before 2026-12-05 one (a dict)."""
    return run if isinstance(run, list) else [run]


def predict_run(off_run, on_run, config: str, clock, anchor: bool) -> dict:
    """`predict_ratio` over a run's groups (`group_traces`): each group replayed off and on,
    the run's tok/s its tokens over the groups' replayed seconds, as the benchmark measures
    a run (one group: `predict_ratio`'s result as it is)."""
    parts = [predict_ratio(off, on, config, clock, anchor=anchor)
             for off, on in zip(group_traces(off_run), group_traces(on_run), strict=True)]
    if len(parts) == 1:
        return parts[0]
    tokens = sum(p["output_tokens"] for p in parts)
    off_s = sum(p["output_tokens"] / p["off_tok_s"] for p in parts)
    on_s = sum(p["output_tokens"] / p["on_tok_s"] for p in parts)
    summed = {key: sum(p[key] for p in parts) for key in
              ("off_iterations", "on_iterations", "proposed", "accepted")}
    return {"off_tok_s": tokens / off_s, "on_tok_s": tokens / on_s, "ratio": off_s / on_s,
            "output_tokens": tokens, **summed}


def within(report: dict, bound: float) -> dict[str, list[int]]:
    """Per on setting: [cells whose predicted ratio is within `bound` of the measured,
    cells]."""
    counts: dict[str, list[int]] = {}
    for cells in report["results"].values():
        for cell in cells.values():
            for name, result in cell.items():
                if "replay" in result:
                    count = counts.setdefault(name, [0, 0])
                    count[0] += abs(result["replay"]["error"]) <= bound
                    count[1] += 1
    return counts


# ----------------------------------------------------------------------- summaries
def format_summary(report: dict) -> str:
    """One row per batch cell (and W): each on setting's median ratio (and, with the
    replay, its predicted ratio and that one's error), and whether every output equalled
    off's ("-": not checked)."""
    settings = [n for n in report["settings"] if n != "off"]
    replayed_settings = {n for n in settings if "replay" in report
                         and report["settings"][n] is not None}  # not the control
    head = [f"{n} / off" + (f" | {n} predicted | error" if n in replayed_settings else "")
            for n in settings]
    columns = len(settings) + 2 * len(replayed_settings)
    lines = ["| workload | batch | " + " | ".join(head) + " | identical |",
             "| --- | --- | " + "--- | " * columns + "--- |"]
    for workload, cells in report["results"].items():
        for batch, cell in cells.items():
            values = []
            for n in settings:
                values.append(f"{cell[n]['median_ratio']:.2f}x")
                if n in replayed_settings:
                    replayed = cell[n].get("replay")
                    values += ([f"{replayed['predicted_ratio']:.2f}x",
                                f"{replayed['error']:+.0%}"] if replayed else ["-", "-"])
            checked = [cell[n].get("identical_to_off") for n in settings]
            same = "-" if None in checked else all(checked)
            lines.append(f"| {workload} | {batch} | {' | '.join(values)} | {same} |")
    return "\n".join(lines)


def format_first_groups(report: dict) -> str:
    """Per batch cell of several groups: each on setting's ratio over the whole cell and
    over its first group alone (the cell before 2026-12-05)."""
    lines = []
    for workload, cells in report["results"].items():
        for batch, cell in cells.items():
            for name, result in cell.items():
                if "first_group_ratio" in result:
                    lines.append(f"{workload} batch {batch}: {name} / off "
                                 f"{result['median_ratio']:.2f}x over every prompt, "
                                 f"{result['first_group_ratio']:.2f}x on the first group "
                                 "alone")
    return "\n".join(lines)


def latency_cells(report: dict):
    """(workload, cell label, cell) of every cell: batch, W and online."""
    for workload, cells in report["results"].items():
        for batch, cell in cells.items():
            yield workload, batch if workload == "W" else f"batch {batch}", cell
    for workload, rates in report.get("online", {}).items():
        for rate, cell in rates.items():
            yield workload, f"{rate} req/s", cell


def format_latency(report: dict) -> str:
    """One row per cell and setting: median output tok/s, TPOT p50 / p99 over the rounds,
    and an on setting's median ratios to off (tok/s, TPOT p99)."""
    lines = ["| workload | cell | setting | output tok/s | x off | TPOT p50 ms | TPOT p99 ms "
             "| p99 x off | accepted / proposed |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for workload, label, cell in latency_cells(report):
        for name, result in cell.items():
            runs = result["runs"]
            ratio, p99 = result.get("median_ratio"), result.get("tpot_p99_ratio")
            lines.append(
                f"| {workload} | {label} | {name} | {_median(runs, 'output_tok_s', '.0f')} | "
                f"{_times(ratio)} | {_median(runs, 'tpot_p50_ms', '.1f')} | "
                f"{_median(runs, 'tpot_p99_ms', '.1f')} | {_times(p99)} | "
                f"{_median(runs, 'accepted_tokens', '.0f')} / "
                f"{_median(runs, 'draft_tokens', '.0f')} |")
    return "\n".join(lines)


def _median(runs: list[dict], key: str, spec: str) -> str:
    values = [r[key] for r in runs if r.get(key) is not None]
    return format(statistics.median(values), spec) if values else "-"


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def check_targets(report: dict, setting: str = "auto") -> list[dict]:
    """Issue 35's targets for `setting` against off, each {target, value, met}: grounded at
    batch 1 >= 2x and at 4 >= 1.5x output tok/s; W and every 64-slot cell >= 0.97x; TPOT p99
    no worse than off (<= 1.0x) in every cell, with the control's off2 / off beside it
    (`control`) where the report has one. A cell not run is left out."""
    checks = []

    def at_least(name: str, cell: dict | None, key: str, bound: float) -> None:
        if cell is not None and cell.get(setting, {}).get(key) is not None:
            value = cell[setting][key]
            checks.append({"target": f"{name} >= {bound}x", "value": value,
                           "met": value >= bound})

    results = report["results"]
    at_least("grounded batch 1 tok/s", results.get("grounded", {}).get("1"),
             "median_ratio", 2.0)
    at_least("grounded batch 4 tok/s", results.get("grounded", {}).get("4"),
             "median_ratio", 1.5)
    for workload, cells in results.items():
        if str(W_SLOTS) in cells:
            name = "W tok/s" if workload == "W" else f"{workload} batch {W_SLOTS} tok/s"
            at_least(name, cells[str(W_SLOTS)], "median_ratio", NO_LOSS)
    for workload, label, cell in latency_cells(report):
        p99 = cell.get(setting, {}).get("tpot_p99_ratio")
        if p99 is not None:
            check = {"target": f"{workload} {label} TPOT p99 <= 1.0x off", "value": p99,
                     "met": p99 <= 1.0}
            control = cell.get(CONTROL, {}).get("tpot_p99_ratio")
            if control is not None:
                check["control"] = control
            checks.append(check)
    return checks


def format_targets(checks: list[dict]) -> str:
    return "\n".join(f"{'met    ' if c['met'] else 'NOT met'}  {c['target']}: "
                     f"{c['value']:.2f}x"
                     + (f" ({CONTROL} / off {c['control']:.2f}x)" if "control" in c else "")
                     for c in checks)


# ----------------------------------------------------------------------- running it
def save_traces(path: str, report: dict, traces: dict) -> None:
    """The measurements and every run's trace, for `--from-traces` (gzip JSON)."""
    with gzip.open(path, "wt") as handle:
        json.dump({"report": report, "traces": traces}, handle)


def load_traces(path: str) -> tuple[dict, dict]:
    """(report, traces) of a `save_traces` file; ValueError naming what is wrong."""
    try:
        with gzip.open(path, "rt") as handle:
            data = json.load(handle)
    except (OSError, EOFError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a gzip JSON file of --save-traces ({exc})") from None
    if not isinstance(data, dict) or not {"report", "traces"} <= set(data):
        raise ValueError(f"{path}: expected an object with 'report' and 'traces'")
    return data["report"], data["traces"]


def measure(args, settings: dict[str, str | None], log) -> tuple[dict, dict]:
    """Run every cell: (report without predictions, traces by workload, cell, setting)."""
    bench_cells = args.w or args.online
    engine = {"max_num_seqs": max(*args.batches, W_SLOTS) if bench_cells else max(args.batches),
              "max_model_len": max(args.max_tokens, 384) + 512}
    base = WarmedTarget.load(args.model, **engine)
    targets = {name: base.configured(speculative_config=spec) for name, spec in settings.items()}
    results: dict[str, dict] = {}
    traces: dict[str, dict] = {}
    engines = {name: LLM(engine=target.build()) for name, target in targets.items()}
    kernels = engines["off"].engine.runner.kernels.describe()  # its CPU class: forced or found
    # NOTE: every workload's prompts, so the first cell's first round is not the one that
    # meets their lengths first (2 free prompts only: grounded batch 1's first round ran at
    # 57 tok/s off and 2/3 of auto's later rounds on the Zen 3, its later rounds at 78-88 off)
    warm = [prompt for texts in WORKLOADS.values()
            for prompt in chat_prompts(engines["off"], texts, len(texts))]
    for llm in engines.values():
        run_once(llm, warm, 8)
    for workload in args.workloads:
        results[workload], traces[workload] = {}, {}
        for batch in args.batches:
            log(f"{workload}, batch {batch}:")
            texts = WORKLOADS[workload]
            prompts = chat_prompts(engines["off"], texts, max(batch, len(texts)))
            traces[workload][str(batch)] = {}
            results[workload][str(batch)] = run_cell(engines, prompts, args.max_tokens,
                                                     args.rounds, log,
                                                     traces[workload][str(batch)], batch)
    engines.clear()  # NOTE: their KV pools go before the fresh engines of W and online
    if args.w:
        log(f"W (benchmarks/perf.py's workload_w), {W_SLOTS} slots:")
        traces["W"] = {str(W_SLOTS): {}}
        results["W"] = {str(W_SLOTS): run_bench_cell(targets, workload_w(), BenchSampling(),
                                                     args.rounds, log,
                                                     traces["W"][str(W_SLOTS)])}
    online: dict[str, dict] = {}
    sampling = BenchSampling(temperature=0.0, ignore_eos=False)
    for workload in args.workloads if args.online else ():
        online[workload] = {}
        for rate in args.online:
            log(f"{workload}, online {rate:g} req/s ({args.online_requests} requests):")
            requests = online_workload(WORKLOADS[workload], args.online_requests, rate,
                                       args.max_tokens)
            online[workload][f"{rate:g}"] = run_bench_cell(targets, requests, sampling,
                                                           args.rounds, log)
    report = {"settings": settings, "engine": engine, "kernels": kernels,
              "max_tokens": args.max_tokens,
              "rounds": args.rounds, "results": results}
    if online:
        report["online"] = online
        report["online_requests"] = args.online_requests
    return report, traces


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    p.add_argument("--method", choices=("ngram", "suffix"), default="ngram")
    p.add_argument("--fixed", type=int, default=None, metavar="K",
                   help="also run K drafts per sequence and iteration (e.g. 4)")
    p.add_argument("--control", action="store_true",
                   help=f"also run speculation off on a second engine ({CONTROL}): "
                        f"{CONTROL} / off is the run-to-run noise of each figure")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--workloads", nargs="+", choices=tuple(WORKLOADS),
                   default=list(WORKLOADS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--no-w", dest="w", action="store_false",
                   help=f"skip workload W (64 requests at t=0, {W_SLOTS} slots)")
    p.add_argument("--online", type=float, nargs="*", default=list(ONLINE_RATES),
                   metavar="RATE", help="the online cells' request rates (req/s; default "
                   f"{' '.join(f'{r:g}' for r in ONLINE_RATES)}; none: no online cells)")
    p.add_argument("--online-requests", type=int, default=ONLINE_REQUESTS,
                   help="requests per online run (default %(default)s)")
    p.add_argument("--out", metavar="JSON", nargs="?", const=DEFAULT_OUT,
                   help=f"write the JSON report (default path {DEFAULT_OUT})")
    p.add_argument("--no-replay", dest="replay", action="store_false",
                   help="skip the replay's predicted ratios")
    p.add_argument("--clock", choices=("knee", "linear"), default="knee",
                   help="the replay's clock fit on the off runs: with a knee over rows "
                        "(default) or a line")
    p.add_argument("--no-anchor", dest="anchor", action="store_false",
                   help="the replay's clock as fit: one drafted-row price (a decode's "
                        "attention), its fixed cost not moved to each off run (the clock "
                        "before 2026-12-05)")
    p.add_argument("--profile", metavar="PROFILE.json", default=None,
                   help="the replay's clock: a `slotserve calibrate` profile (default: a fit "
                        "on this run's off iterations)")
    p.add_argument("--save-traces", metavar="PATH", default=None,
                   help="also write the measurements and every run's trace (gzip JSON)")
    p.add_argument("--from-traces", metavar="PATH", default=None,
                   help="run nothing: predict from a --save-traces file")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.max_tokens < 1 or min(args.batches) < 1 \
            or args.online_requests < 1:
        p.error("--rounds, --max-tokens, --batches and --online-requests must be at least 1")
    if any(not (math.isfinite(rate) and rate > 0) for rate in args.online):
        p.error("--online: rates must be finite numbers > 0 (req/s)")
    args.profile_path = args.profile
    try:
        args.profile = load_profile(args.profile) if args.replay and args.profile else None
    except (ValueError, OSError) as exc:
        p.error(f"--profile: {exc}")
    if args.from_traces:
        try:
            args.loaded = load_traces(args.from_traces)
        except ValueError as exc:
            p.error(f"--from-traces: {exc}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    if args.from_traces:
        report, traces = args.loaded
    else:
        lookup = ({"prompt_lookup_min": 2, "prompt_lookup_max": 5} if args.method == "ngram"
                  else {})
        settings: dict[str, str | None] = {
            "off": None, "auto": json.dumps({"method": args.method, **lookup})}
        if args.fixed is not None:
            settings[f"fixed{args.fixed}"] = json.dumps(
                {"method": args.method, "num_speculative_tokens": args.fixed, **lookup})
        if args.control:
            settings[CONTROL] = None
        started = time.perf_counter()
        report, traces = measure(args, settings, log)
        report["seconds"] = round(time.perf_counter() - started, 1)
        if args.save_traces:
            save_traces(args.save_traces, report, traces)
            log(f"wrote {args.save_traces}")
    if args.replay:
        try:
            cost_model, source = replay_cost_model(args.profile, traces, log, args.clock,
                                                   args.anchor)
            add_predictions(report, traces, cost_model, anchor=args.anchor, log=log)
            report["replay"] = {"clock": source, "profile": args.profile_path,
                                "cost_model": cost_model.describe(),
                                "anchored": args.anchor,
                                "fit": cost_model.meta.get("fit"),
                                "within": within(report, PREDICTION_BOUND)}
        except ValueError as exc:  # NOTE: the measurements are reported all the same
            log(f"replay: no prediction: {exc}")
            report["replay_error"] = str(exc)
    report["targets"] = check_targets(report)
    print(format_summary(report))
    print()
    first_groups = format_first_groups(report)
    if first_groups:
        print(first_groups)
        print()
    print(format_latency(report))
    print()
    print(format_targets(report["targets"]))
    for name, counts in report.get("replay", {}).get("within", {}).items():
        print(f"replay: {name} / off predicted within {PREDICTION_BOUND:.0%} in "
              f"{counts[0]} of {counts[1]} cells")
    if args.out:
        write_report(args.out, model=args.model or "embedded", **report)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
