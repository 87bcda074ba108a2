"""Predicting a measured batch run's speculation on/off tok/s ratio by replay (issue 35).

`predict_ratio`: the off run's requests replayed with speculation off and on, the drafts
offered and accepted where the on run's trace recorded them (`speculation.DraftOracle`), on
one clock (e.g. `fit_trace_cost`: a fit on recorded runs' own iteration times,
`trace_samples`). `benchmarks/speculative.py` prints it beside the measured ratio.

The benchmark's clock (2026-12-05): `fit_trace_cost(per_run_base=True)` on every off run
(a base per run, the rest shared), `with_draft_pairs` on the other cells' runs with drafts
(a verification's drafted rows' attention), and `predict_ratio(anchor=True)` (the base moved
to the cell's off run: `anchored`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields, replace

import numpy as np

from slotserve.config import SlotKind
from slotserve.core.outputs import ScheduledSeq, SchedulerOutput
from slotserve.lab.replay.cost_model import LinearCost, StepFeatures
from slotserve.lab.replay.inputs import requests_from_trace
from slotserve.lab.replay.simulator import ReplaySettings, planner_state_for, replay
from slotserve.lab.replay.speculation import FILLER_DRAFT, recorded_verifications, slot_drafts
from slotserve.sampling import SamplingParams


def batch_requests(trace: dict):
    """(requests, settings, cached prefixes) to replay a run that sent all its requests at
    once: the trace's requests at arrival 0, the settings it recorded (slots, KV pool,
    admission rule, budget...), speculation off, and what its prefix cache held before it
    (`replay`'s cached_prefixes: a benchmark sends the same prompts round after round).

    NOTE: a batch's arrivals in a trace are microseconds apart (the adds before the first
    step); replayed as they are, the first iteration would admit only the first request,
    where the engine's first step saw them all waiting.
    """
    requests, info = requests_from_trace(trace)
    known = {f.name for f in fields(ReplaySettings)}
    recorded = {k: v for k, v in (info.get("trace_settings") or {}).items()
                if k in known and v is not None}
    header = {"max_num_seqs": info.get("trace_num_slots"),
              "num_blocks": info.get("trace_kv_blocks"), "batching": info.get("trace_policy")}
    recorded |= {k: v for k, v in header.items() if v is not None}
    recorded["speculative_config"] = None
    return ([replace(r, arrival=0.0, verifications=()) for r in requests],
            ReplaySettings(**recorded), info["trace_cached_prefixes"])


def iteration_seconds(trace: dict) -> list[float]:
    """Each iteration's served time in a recorded trace: from its start to the next one's
    (the forward, sampling, the scheduler and the engine's bookkeeping, as `slotserve
    calibrate` times a whole `engine.step()`); the last one to its own end."""
    iterations = trace["iterations"]
    starts = [float(it["start"]) for it in iterations]
    ends = starts[1:] + [float(iterations[-1]["end"])] if iterations else []
    return [end - start for start, end in zip(starts, ends)]


def trace_plans(trace: dict) -> list:
    """Each iteration of a recorded trace as the plan it ran (`SchedulerOutput`, as far as
    `StepFeatures.of` reads one: each slot's kind, tokens, start position, drafts and
    whether it sampled), rebuilt from the slots alone.

    A request's first chunk starts after its prefix-cache hit (`cached_tokens`); each
    chunk moves it on by its tokens, a verification by 1 + accepted; a chunk samples when
    it reaches the request's last token (prompt and outputs so far). NOTE: a preempted
    request restarts at 0 (a trace does not record the hit of its recompute).
    """
    params = SamplingParams()
    records = {str(r["id"]): r for r in trace.get("requests") or ()}
    position = {rid: int(r.get("cached_tokens") or 0) for rid, r in records.items()}
    outputs = dict.fromkeys(records, 0)
    plans = []
    for iteration in trace["iterations"]:
        seqs = []
        for slot in iteration.get("slots") or ():
            if not slot or slot.get("kind") not in ("prefill", "decode"):
                continue
            rid = str(slot["request"])
            if rid not in records:
                raise ValueError(f"iteration {iteration.get('index')}: request {rid!r} is "
                                 "not among the trace's requests")
            proposed, accepted = slot_drafts(slot, iteration)
            start, tokens = position[rid], int(slot["tokens"])
            sample = start + tokens - proposed >= records[rid]["prompt_tokens"] + outputs[rid]
            kind = SlotKind.DECODE if slot["kind"] == "decode" else SlotKind.PREFILL
            seqs.append(ScheduledSeq(rid, [FILLER_DRAFT] * tokens, start, [], sample, params,
                                     outputs[rid], kind, [FILLER_DRAFT] * proposed))
            position[rid] = start + tokens - proposed + accepted
            outputs[rid] += (1 + accepted) if sample else 0
        for rid in iteration.get("preempted") or ():
            position[str(rid)] = 0
        plans.append(SchedulerOutput(int(iteration.get("index", len(plans))), seqs, []))
    return plans


def trace_samples(trace: dict) -> list[tuple]:
    """(StepFeatures, seconds) of every iteration of a recorded trace: the features of its
    plan (`trace_plans`; iteration 0 is the engine's first forward), the seconds it took
    (`iteration_seconds`)."""
    return [(StepFeatures.of(plan, first_forward=plan.iteration == 0), seconds)
            for plan, seconds in zip(trace_plans(trace), iteration_seconds(trace))
            if plan.seqs and seconds > 0]


def fit_trace_cost(traces: Sequence[dict], meta: dict | None = None,
                   knee: float | str | None = "auto",
                   verification_traces: Sequence[dict] = (), per_run_base: bool = False):
    """A `LinearCost` fit (as `slotserve calibrate` fits its grid) on the iterations of
    recorded batch runs (`trace_samples`): the clock of the machine, model and kernels that
    ran them, at the batch sizes and contexts they reached.

    knee: as `LinearCost.fit`'s; "auto" (default): the rows past which a step turns
    compute-bound, if a knee fits the iterations better than a line (the decode stack reads
    the weights once per step, so a batch-1 verification's drafts cost little).
    verification_traces: runs with speculation; if given, their verifications price the
    drafted rows' attention (`with_draft_pairs`).
    per_run_base: each trace a base of its own (`LinearCost.fit`'s groups; the model's
    base is their median: move it to a run with `anchored`)."""
    per_trace = [trace_samples(trace) for trace in traces]
    samples = [sample for run in per_trace for sample in run]
    groups = [i for i, run in enumerate(per_trace) for _ in run] if per_run_base else None
    model = LinearCost.fit(samples, meta={"source": "trace fit", **(meta or {})}, knee=knee,
                           groups=groups)
    model.meta["fit"] = model.residuals(samples)
    return with_draft_pairs(model, verification_traces) if verification_traces else model


def with_draft_pairs(model: LinearCost, traces: Sequence[dict]) -> LinearCost:
    """`model` with the drafted rows' attention priced on these runs' verifications
    (`LinearCost.fit_draft_pairs`, each run's speed its own); ValueError when they have too
    few."""
    priced = model.fit_draft_pairs([trace_samples(trace) for trace in traces])
    priced.meta["draft_pairs_from"] = len(traces)
    return priced


def anchored(model: LinearCost, trace: dict) -> LinearCost:
    """`model` with its fixed cost per iteration moved so that it prices a recorded run's
    iterations of decodes only at what they measured, in the median: base + the median of
    (measured - predicted) over them (the model as it is if the run has none).

    NOTE: a fit over several runs has one base, but a run can pay a cost per step that no
    feature sees (a workload's own bookkeeping; a host that ran slower): the quiet
    2026-12-04 run's grounded batch-1 decodes took ~8 ms (TPOT) where the fit priced ~6.3,
    and a fixed cost priced too low makes each verification's rows weigh more than they do
    (predicted x1.40 against x1.75-1.87 measured). The on/off ratio lives in the decodes,
    so they set the level.
    """
    samples = [(f, seconds) for f, seconds in trace_samples(trace) if f.prefill_tokens == 0]
    if not samples:
        return model
    shift = float(np.median([seconds - model.step_seconds(f) for f, seconds in samples]))
    meta = {**model.meta, "anchored_ms": shift * 1000}
    return LinearCost(model.base + shift, dict(model.coefficients), meta, model.knee)


def predict_ratio(off_trace: dict, on_trace: dict, speculative_config: str,
                  cost_model, anchor: bool = False) -> dict:
    """The replay's prediction of a batch run's output tok/s with speculation on against
    off, from the two measured runs of the same prompts.

    The off run's requests (`batch_requests`) are replayed twice on `cost_model`: with
    speculation off, and with `speculative_config` with the drafts the on run's trace
    offered and accepted (`recorded_verifications`, per request and output position: the
    replay's `DraftOracle`; its own speculator, on the replay's clock, decides how many
    to verify, from where the on run's planning started: its `planner_state`, if recorded).
    Requests are matched by order (both runs added the same prompts in the same order);
    ValueError when the runs' requests differ in number or prompt length.

    anchor: first move `cost_model`'s fixed cost to the off run's own decodes (`anchored`;
    a LinearCost only).

    Returns off_tok_s, on_tok_s (output tokens / replayed seconds), ratio (on / off), the
    off replay's output_tokens, the replays' iterations and the drafts the on replay
    proposed and accepted.
    """
    if anchor:
        cost_model = anchored(cost_model, off_trace)
    requests, settings, cached = batch_requests(off_trace)
    on_requests = [r for r in on_trace.get("requests") or () if r.get("output_tokens")]
    if [r["prompt_tokens"] for r in on_requests] != [r.prompt_tokens for r in requests]:
        raise ValueError("on_trace: its requests' prompt lengths are not the off run's "
                         "(not the same prompts in the same order)")
    verifications = recorded_verifications(on_trace["iterations"])
    drafted = [replace(r, verifications=tuple(verifications.get(str(on["id"]), ())))
               for r, on in zip(requests, on_requests)]
    off = replay(requests, settings, cost_model, cached_prefixes=cached)
    state = planner_state_for(cost_model, on_trace.get("planner_state"))
    on = replay(drafted, replace(settings, speculative_config=speculative_config), cost_model,
                planner_state=state, cached_prefixes=cached)
    off_tok_s, on_tok_s = _tok_s(off), _tok_s(on)
    slots = [s for it in on.trace["iterations"] for s in it["slots"] if s and s.get("proposed")]
    return {"off_tok_s": off_tok_s, "on_tok_s": on_tok_s, "ratio": on_tok_s / off_tok_s,
            "output_tokens": sum(len(o.token_times) for o in off.outcomes),
            "off_iterations": off.iterations, "on_iterations": on.iterations,
            "proposed": sum(s["proposed"] for s in slots),
            "accepted": sum(s["accepted"] for s in slots)}


def _tok_s(result) -> float:
    tokens = sum(len(o.token_times) for o in result.outcomes)
    if not result.duration > 0:
        raise ValueError("the replay took no time: the cost model prices every iteration "
                         "at 0 s")
    return tokens / result.duration
