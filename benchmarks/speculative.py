"""Speculative decoding on against off: output tok/s and TPOT, interleaved, per batch size.

    PYTHONPATH=src python -m benchmarks.speculative --rounds 3 --out

One engine per setting in process (the embedded SmolLM2-135M unless --model): speculation
off, `--speculative-config` "auto" (default: ngram, prompt_lookup 2..5) and, with
`--fixed K`, the same method at a fixed K drafts. Two workloads of greedy chat requests:
`grounded` (answers that copy from their input: a code edit that repeats most of a
function, fields extracted verbatim from a given text, a passage quoted back) and `free`
(open questions, little to copy). For each workload and batch size (`--batches`, default
1 4 16 64: that many requests sent at once, max_num_seqs 64) every round runs each setting
once, in an order that rotates round by round, so a drift of the host's speed falls on
every side. Per run: output tokens / wall time, TPOT p50 / p99 over the completions, and
whether the tokens equal the off run's (greedy: they must, up to the near-tie rule of
docs/ARCHITECTURE.md). The summary gives the median ratio on / off per cell.

The replay's prediction (issue 35: within 15% of the measured ratio; `--no-replay` skips
it): per cell and round, the off run's trace is replayed (`slotserve.lab.replay`, no model)
with speculation off and with the setting's config, drafts offered and accepted where that
round's on run recorded them (per request and output position: the replay's DraftOracle;
how many to verify its own speculator decides, on the replay's clock). Predicted ratio:
replayed on tok/s / replayed off tok/s, median over the rounds; its error against the
measured median. The clock: a LinearCost fit, as `slotserve calibrate` fits one, on every
iteration of this benchmark's off runs (their trace times: the machine, model and kernels
measured, no extra run), or `--profile PROFILE.json` (a `slotserve calibrate` profile).
NOTE: the fit tells a decode row's cost from an iteration's fixed cost only across batch
sizes (a verification's drafts are decode rows); with one `--batches` value, use --profile.

`--out [PATH]` writes the JSON report (default: benchmarks/results/speculative.json).
NOTE: the lead runs it on a quiet machine; a loaded 2-core box swings tok/s several-fold.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from slotserve import SamplingParams
from slotserve.engine.llm import LLM
from slotserve.lab.bench.report import write_report
from slotserve.lab.replay.cost_model import load_profile
from slotserve.lab.replay.spec_prediction import fit_trace_cost, predict_ratio
from slotserve.percentile import percentile

DEFAULT_OUT = "benchmarks/results/speculative.json"
PREDICTION_BOUND = 0.15  # issue 35: the replay predicts the on/off ratio within 15%
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
    """One batch sent at once: tokens, wall time, tok/s, TPOT p50/p99, the token ids and
    the run's iteration trace (`trace`: for the replay; not written to the report)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    spec = llm.engine.scheduler.speculator
    before = (spec.num_draft_tokens, spec.num_accepted_tokens) if spec else (0, 0)
    llm.engine.trace.clear()  # NOTE: the trace of this run only
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
            "token_ids": [list(c.token_ids) for c in completions], "trace": trace}


def run_cell(engines: dict[str, LLM], prompts: list[list[int]], max_tokens: int,
             rounds: int, log, traces: dict[str, list[dict]] | None = None) -> dict:
    """`rounds` runs of every setting on one workload and batch size, order rotating.

    traces: filled with each setting's run traces, in round order (for the replay)."""
    names = list(engines)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for number in range(rounds):
        order = names[number % len(names):] + names[:number % len(names)]
        for name in order:
            result = run_once(engines[name], prompts, max_tokens)
            runs[name].append(result)
            log(f"  round {number + 1} {name}: {result['output_tok_s']:.1f} tok/s, TPOT p99 "
                f"{result['tpot_p99_ms'] or 0:.1f} ms, drafts {result['draft_tokens']} "
                f"accepted {result['accepted_tokens']}")
    reference = runs["off"][0]["token_ids"]
    cell = {}
    for name in names:
        same = all(r["token_ids"] == reference for r in runs[name])
        recorded = [r.pop("trace") for r in runs[name]]
        if traces is not None:
            traces[name] = recorded
        for r in runs[name]:
            r.pop("token_ids")
        cell[name] = {"runs": runs[name], "identical_to_off": same}
        if name != "off":
            ratios = [on["output_tok_s"] / off["output_tok_s"]
                      for on, off in zip(runs[name], runs["off"])]
            cell[name]["median_ratio"] = statistics.median(ratios)
    return cell


def replay_cost_model(profile, traces: dict, log):
    """The replay's clock and what it is: the profile (a LinearCost) if given, else a fit
    on every off run's iterations."""
    if profile is not None:
        return profile, "profile"
    off = [t for cells in traces.values() for cell in cells.values() for t in cell["off"]]
    model = fit_trace_cost(off, meta={"runs": len(off)})
    fit = model.meta["fit"]
    log(f"replay clock: fit on {len(off)} off runs' {fit['samples']} iterations, median "
        f"error {fit['median_rel_error']:.1%}, total {fit['total_rel_error']:.1%}")
    return model, "fit on the off runs' iterations"


def add_predictions(report: dict, traces: dict, cost_model) -> None:
    """Each on setting's predicted ratio per cell (median over rounds of `predict_ratio` on
    that round's off and on traces) and its relative error against the measured median;
    beside it the replayed off tok/s against the measured (how well the clock fits)."""
    for workload, cells in report["results"].items():
        for batch, cell in cells.items():
            measured_off = statistics.median(r["output_tok_s"] for r in cell["off"]["runs"])
            for name, config in report["settings"].items():
                if config is None:
                    continue
                rounds = [predict_ratio(off, on, config, cost_model) for off, on in
                          zip(traces[workload][batch]["off"], traces[workload][batch][name])]
                predicted = statistics.median(r["ratio"] for r in rounds)
                off_tok_s = statistics.median(r["off_tok_s"] for r in rounds)
                cell[name]["replay"] = {
                    "predicted_ratio": predicted,
                    "error": predicted / cell[name]["median_ratio"] - 1,
                    "off_tok_s": off_tok_s, "off_error": off_tok_s / measured_off - 1,
                    "rounds": rounds}


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


def format_summary(report: dict) -> str:
    """One row per cell: each on setting's median ratio (and, with the replay, its
    predicted ratio and that one's error), and whether every output equalled off's."""
    settings = [n for n in report["settings"] if n != "off"]
    predicted = "replay" in report
    head = [f"{n} / off" + (f" | {n} predicted | error" if predicted else "")
            for n in settings]
    columns = len(settings) * (3 if predicted else 1)
    lines = ["| workload | batch | " + " | ".join(head) + " | identical |",
             "| --- | --- | " + "--- | " * columns + "--- |"]
    for workload, cells in report["results"].items():
        for batch, cell in cells.items():
            values = []
            for n in settings:
                values.append(f"{cell[n]['median_ratio']:.2f}x")
                if predicted:
                    replayed = cell[n].get("replay")
                    values += ([f"{replayed['predicted_ratio']:.2f}x",
                                f"{replayed['error']:+.0%}"] if replayed else ["-", "-"])
            same = all(cell[n]["identical_to_off"] for n in settings)
            lines.append(f"| {workload} | {batch} | {' | '.join(values)} | {same} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    p.add_argument("--method", choices=("ngram", "suffix"), default="ngram")
    p.add_argument("--fixed", type=int, default=None, metavar="K",
                   help="also run K drafts per sequence and iteration (e.g. 4)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--workloads", nargs="+", choices=tuple(WORKLOADS),
                   default=list(WORKLOADS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--out", metavar="JSON", nargs="?", const=DEFAULT_OUT,
                   help=f"write the JSON report (default path {DEFAULT_OUT})")
    p.add_argument("--no-replay", dest="replay", action="store_false",
                   help="skip the replay's predicted ratios")
    p.add_argument("--profile", metavar="PROFILE.json", default=None,
                   help="the replay's clock: a `slotserve calibrate` profile (default: a fit "
                        "on this run's off iterations)")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.max_tokens < 1 or min(args.batches) < 1:
        p.error("--rounds, --max-tokens and --batches must be at least 1")
    try:
        profile = load_profile(args.profile) if args.replay and args.profile else None
    except (ValueError, OSError) as exc:
        p.error(f"--profile: {exc}")
    lookup = {"prompt_lookup_min": 2, "prompt_lookup_max": 5} if args.method == "ngram" else {}
    settings: dict[str, str | None] = {
        "off": None, "auto": json.dumps({"method": args.method, **lookup})}
    if args.fixed is not None:
        settings[f"fixed{args.fixed}"] = json.dumps(
            {"method": args.method, "num_speculative_tokens": args.fixed, **lookup})
    engine = {"max_num_seqs": max(args.batches), "max_model_len": args.max_tokens + 512}
    engines = {name: LLM(args.model, speculative_config=spec, **engine)
               for name, spec in settings.items()}
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    warm = chat_prompts(engines["off"], FREE, 2)
    for llm in engines.values():
        run_once(llm, warm, 8)
    results: dict[str, dict] = {}
    traces: dict[str, dict] = {}
    for workload in args.workloads:
        results[workload], traces[workload] = {}, {}
        for batch in args.batches:
            log(f"{workload}, batch {batch}:")
            prompts = chat_prompts(engines["off"], WORKLOADS[workload], batch)
            traces[workload][str(batch)] = {}
            results[workload][str(batch)] = run_cell(engines, prompts, args.max_tokens,
                                                     args.rounds, log,
                                                     traces[workload][str(batch)])
    report = {"settings": settings, "engine": engine, "max_tokens": args.max_tokens,
              "rounds": args.rounds, "results": results}
    if args.replay:
        try:
            cost_model, source = replay_cost_model(profile, traces, log)
            add_predictions(report, traces, cost_model)
            report["replay"] = {"clock": source, "profile": args.profile,
                                "cost_model": cost_model.describe(),
                                "fit": cost_model.meta.get("fit"),
                                "within": within(report, PREDICTION_BOUND)}
        except ValueError as exc:  # NOTE: the measurements are reported all the same
            log(f"replay: no prediction: {exc}")
            report["replay_error"] = str(exc)
    print(format_summary(report))
    for name, counts in report.get("replay", {}).get("within", {}).items():
        print(f"replay: {name} / off predicted within {PREDICTION_BOUND:.0%} in "
              f"{counts[0]} of {counts[1]} cells")
    if args.out:
        write_report(args.out, model=args.model or "embedded", **report)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
