"""Speculative decoding in a replay: drafts planned by the real speculator, accepted as the
trace says they were.

A replay computes no logits, so it cannot know which drafts a model would accept; a trace
records, per iteration and slot, how many draft tokens a sequence verified (`proposed`,
among its `tokens`) and how many were accepted (`accepted`). `recorded_verifications` walks
the trace and places each verification at its request's output position t (tokens generated
before it): `(t, proposed, accepted)`.

In the replay the scheduler's own `Speculator` (fixed or "auto", on the replay's clock) plans
drafts; `DraftOracle` stands for the proposer and for the model's verdict. A verification
recorded at t with p drafts and a accepted says the sequence at t had p drafts to offer and
its first a were right; at t + i (i <= a: inside that accepted run, where a replay that drafted
fewer may stand) it had p - i and a - i. A position the trace never drafted at offers none
(its proposer found nothing, or "auto" gave it none). So a replay with the run's own settings
verifies the same drafts in the same iterations as the run did, and one with other settings
(more slots, a fixed length) drafts at most what the proposer offered and accepts what the
model accepted. A verification costs 1 + k rows with logits at each: decode rows in an
iteration of decodes only (the C++ decode stack runs it so), a 1 + k token chunk beside a
prefill (`StepFeatures.of`).

`predict_ratio` predicts a measured batch run's on/off tok/s ratio: the off run's requests
replayed off and on, with the drafts the on run's trace recorded, on one clock (e.g.
`fit_trace_cost`: a fit on recorded runs' own iteration times, `trace_samples`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from slotserve.spec.config import SpeculativeConfig
from slotserve.spec.planner import Speculator

FILLER_DRAFT = 3  # the draft token proposed (never read: only its count matters)
# The config a trace with drafts replays with when none is given: "auto", the default when
# speculation is on (the method only chooses the proposer, which the replay replaces).
TRACE_DEFAULT_CONFIG = '{"method": "ngram", "num_speculative_tokens": "auto"}'

Verification = tuple[int, int, int]  # (output position, drafts proposed, drafts accepted)


def recorded_verifications(iterations: Iterable[dict]) -> dict[str, list[Verification]]:
    """Each request's verifications, at their output positions, from a trace's iterations.

    A request's output position is 1 at its first decode (its last prefill chunk sampled
    one token) and grows by 1 + accepted per decode; a decode after prefill chunks again
    (recomputed after a preemption) follows one more sampled token. ValueError on a slot
    whose counts make no sense.
    """
    position: dict[str, int] = {}
    last_kind: dict[str, str] = {}
    found: dict[str, list[Verification]] = {}
    for iteration in iterations:
        for slot in iteration.get("slots") or ():
            if not slot or slot.get("kind") not in ("prefill", "decode"):
                continue
            request = str(slot["request"])
            kind, before = slot["kind"], last_kind.get(request)
            last_kind[request] = kind
            if kind == "prefill":
                continue
            t = position.get(request, 0) + int(before in (None, "prefill"))
            proposed, accepted = _counts(slot, iteration)
            if proposed:
                found.setdefault(request, []).append((t, proposed, accepted))
            position[request] = t + 1 + accepted
    return found


def _counts(slot: dict, iteration: dict) -> tuple[int, int]:
    proposed, accepted = slot.get("proposed", 0), slot.get("accepted", 0)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (proposed, accepted)) \
            or not 0 <= accepted <= proposed:
        raise ValueError(f"iteration {iteration.get('index')}: slot of "
                         f"{slot.get('request')!r}: proposed {proposed!r} / accepted "
                         f"{accepted!r} must be integers with 0 <= accepted <= proposed")
    return proposed, accepted


class DraftOracle:
    """What each request had to offer and what was right, by output position (see the
    module docstring): the replay's proposer (`propose`) and verdict (`accepted`)."""

    def __init__(self, verifications: Mapping[str, Sequence[Verification]]) -> None:
        self._at: dict[str, dict[int, tuple[int, int]]] = {}
        for request, records in verifications.items():
            at = self._at[request] = {}
            for t, proposed, accepted in records:
                for i in range(accepted + 1):
                    at.setdefault(t + i, (proposed - i, accepted - i))

    def propose(self, seq_id: str, prompt_ids: Sequence[int], output_ids: Sequence[int],
                max_tokens: int) -> list[int]:
        offered, _ = self._at.get(seq_id, {}).get(len(output_ids), (0, 0))
        return [FILLER_DRAFT] * max(0, min(max_tokens, offered))

    def accepted(self, seq_id: str, position: int, num_drafts: int) -> int:
        """Of num_drafts drafts verified at output position `position`, those accepted."""
        _, right = self._at.get(seq_id, {}).get(position, (0, 0))
        return min(right, num_drafts)

    def finish(self, seq_id: str, output_ids: Sequence[int]) -> None:
        pass

    def forget(self, seq_id: str) -> None:
        pass


def make_speculator(config: SpeculativeConfig | None, oracle: DraftOracle
                    ) -> Speculator | None:
    """The scheduler's speculator for a replay (None when speculation is off)."""
    if config is None:
        return None
    return Speculator(config, proposer=oracle)


# ---------------------------------------------------------------------------------------
# Predicting a benchmark's on/off ratio from its measured runs' traces
# NOTE: these import the simulator, inputs and cost model inside the functions: those
# modules import this one (the oracle, recorded_verifications).
# ---------------------------------------------------------------------------------------

def batch_requests(trace: dict):
    """(requests, settings) to replay a run that sent all its requests at once: the trace's
    requests at arrival 0 and the settings it recorded (slots, KV pool, admission rule,
    budget...), speculation off.

    NOTE: a batch's arrivals in a trace are microseconds apart (the adds before the first
    step); replayed as they are, the first iteration would admit only the first request,
    where the engine's first step saw them all waiting.
    """
    from dataclasses import fields, replace

    from slotserve.lab.replay.inputs import requests_from_trace
    from slotserve.lab.replay.simulator import ReplaySettings

    requests, info = requests_from_trace(trace)
    known = {f.name for f in fields(ReplaySettings)}
    recorded = {k: v for k, v in (info.get("trace_settings") or {}).items()
                if k in known and v is not None}
    header = {"max_num_seqs": info.get("trace_num_slots"),
              "num_blocks": info.get("trace_kv_blocks"), "batching": info.get("trace_policy")}
    recorded |= {k: v for k, v in header.items() if v is not None}
    recorded["speculative_config"] = None
    return ([replace(r, arrival=0.0, verifications=()) for r in requests],
            ReplaySettings(**recorded))


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
    from slotserve.config import SlotKind
    from slotserve.core.outputs import ScheduledSeq, SchedulerOutput
    from slotserve.sampling import SamplingParams

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
            proposed, accepted = _counts(slot, iteration)
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
    plan (`trace_plans`), the seconds it took (`iteration_seconds`)."""
    from slotserve.lab.replay.cost_model import StepFeatures

    return [(StepFeatures.of(plan), seconds) for plan, seconds in
            zip(trace_plans(trace), iteration_seconds(trace)) if plan.seqs and seconds > 0]


def fit_trace_cost(traces: Sequence[dict], meta: dict | None = None):
    """A `LinearCost` fit (as `slotserve calibrate` fits its grid) on the iterations of
    recorded batch runs (`trace_samples`): the clock of the machine, model and kernels that
    ran them, at the batch sizes and contexts they reached."""
    from slotserve.lab.replay.cost_model import LinearCost

    samples = [sample for trace in traces for sample in trace_samples(trace)]
    model = LinearCost.fit(samples, meta={"source": "trace fit", **(meta or {})})
    model.meta["fit"] = model.residuals(samples)
    return model


def predict_ratio(off_trace: dict, on_trace: dict, speculative_config: str,
                  cost_model) -> dict:
    """The replay's prediction of a batch run's output tok/s with speculation on against
    off, from the two measured runs of the same prompts.

    The off run's requests (`batch_requests`) are replayed twice on `cost_model`: with
    speculation off, and with `speculative_config` with the drafts the on run's trace
    offered and accepted (`recorded_verifications`, per request and output position: the
    replay's `DraftOracle`; its own speculator, on the replay's clock, decides how many
    to verify). Requests are matched by order (both runs added the same prompts in the same
    order); ValueError when the runs' requests differ in number or prompt length.

    Returns off_tok_s, on_tok_s (output tokens / replayed seconds), ratio (on / off), the
    replays' iterations and the drafts the on replay proposed and accepted.
    """
    from dataclasses import replace

    from slotserve.lab.replay.simulator import replay

    requests, settings = batch_requests(off_trace)
    on_requests = [r for r in on_trace.get("requests") or () if r.get("output_tokens")]
    if [r["prompt_tokens"] for r in on_requests] != [r.prompt_tokens for r in requests]:
        raise ValueError("on_trace: its requests' prompt lengths are not the off run's "
                         "(not the same prompts in the same order)")
    verifications = recorded_verifications(on_trace["iterations"])
    drafted = [replace(r, verifications=tuple(verifications.get(str(on["id"]), ())))
               for r, on in zip(requests, on_requests)]
    off = replay(requests, settings, cost_model)
    on = replay(drafted, replace(settings, speculative_config=speculative_config), cost_model)
    off_tok_s, on_tok_s = _tok_s(off), _tok_s(on)
    slots = [s for it in on.trace["iterations"] for s in it["slots"] if s and s.get("proposed")]
    return {"off_tok_s": off_tok_s, "on_tok_s": on_tok_s, "ratio": on_tok_s / off_tok_s,
            "off_iterations": off.iterations, "on_iterations": on.iterations,
            "proposed": sum(s["proposed"] for s in slots),
            "accepted": sum(s["accepted"] for s in slots)}


def _tok_s(result) -> float:
    tokens = sum(len(o.token_times) for o in result.outcomes)
    if not result.duration > 0:
        raise ValueError("the replay took no time: the cost model prices every iteration "
                         "at 0 s")
    return tokens / result.duration
