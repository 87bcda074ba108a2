"""`Speculator`: how many draft tokens each running decode verifies this iteration (no torch).

The scheduler calls `plan` once per iteration, after the running requests got their decode
tokens and prefill chunks and before waiting requests are admitted, so draft tokens draw on
what is left of the token budget then. A drafted sequence is verified as a chunk of k + 1
tokens (its last sampled token and the k drafts), with logits at each of them.

How many:
- fixed (`num_speculative_tokens` an integer): that many, fewer when the proposer has fewer,
  the sequence's max_tokens or length cap is closer, or the budget is short;
- "auto": the plan that maximises the geometric mean of the producing sequences' expected
  token rates (at batch 1: expected tokens per second). A sequence whose drafts are each
  accepted with probability a (given the ones before were: its observed rate in its
  present state, see `AcceptanceStats`) gains a^j expected tokens from its j-th draft; the
  iteration costs `cost.seconds(tokens)` (the scheduler's `DecodeStepCost`: a line with a
  knee). Draft increments are taken in order of gain (log1p(a^j / the sequence's expected
  tokens so far)); the plan is the prefix of them with the highest sum over the B
  producing sequences of log(expected tokens / step seconds), looked for until
  `lookahead_window` increments bring no higher sum. It is zero when the batch is large: a
  sequence's first draft pays only while log1p(a) > B x log1p(per_token / seconds); B x
  per_token / seconds nears 1 as decodes fill a compute-bound step, and past log 2 no
  draft pays (nor do more: past the knee a step's cost is nearly proportional to its rows).

NOTE: the proposer is only asked for the sequences that get drafts, so a large batch costs
no proposal work.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from slotserve.core.queue_policy import CostModel
from slotserve.spec.config import SpeculativeConfig
from slotserve.spec.proposers import NgramProposer, Proposer, SuffixProposer
from slotserve.value_checks import is_finite_number, is_int

# A sequence's acceptance prior in each state: PRIOR_WEIGHT drafts at the engine's pooled
# rate of that state (`PooledAcceptance`; Beta(1, 1), i.e. 0.5, before it has seen any).
PRIOR_WEIGHT = 2.0
# The most drafts the pooled prior of a span counts as (`span_prior_weight`).
MAX_SPAN_PRIOR_WEIGHT = 100.0
# The pooled record forgets a verification's weight by this factor at each new one (a memory
# of ~1/(1 - f) verifications: it follows a change of workload).
POOL_FORGET = 0.99
# The default step cost until the scheduler's own fit knows a fixed cost per step: an
# iteration costs as much as DEFAULT_OVERHEAD_TOKENS tokens' work besides its tokens (reading
# the weights; a small model on a CPU measured 20-60; a GPU is in the hundreds).
DEFAULT_OVERHEAD_TOKENS = 32.0
# "auto" plans again at most this many times when the proposer has fewer drafts than planned
# (`Speculator._proposed_lengths`).
PROPOSAL_ROUNDS = 3
# "auto": after this many iterations in a row without drafts on a fitted step cost, one
# is planned on the prior (`Speculator._auto_wanted`).
EXPLORE_AFTER = 16
# `DecodeStepCost` fits its hinge every REFIT_EVERY observations (a fit over ~10-20 row
# counts took 30-45 us, ~0.4% of a 10 ms step, every iteration); the bins, its line and the
# stall rule see every observation.
REFIT_EVERY = 4
# `DecodeStepCost`: an iteration slower than STALL_FACTOR x the line's estimate is a stall,
# not its tokens' cost; after MAX_STALLS such iterations in a row the host's speed changed
# and they count again.
STALL_FACTOR = 3.0
MAX_STALLS = 3


class StepCost(Protocol):
    """The estimated seconds (or any unit) of an iteration of num_tokens batched tokens;
    `verify_extra`: what an iteration with drafts costs besides its rows."""

    verify_extra: float

    def seconds(self, num_tokens: int) -> float: ...


class LinearStepCost:
    """overhead + per_token x n (the default: DEFAULT_OVERHEAD_TOKENS tokens of overhead)."""

    def __init__(self, overhead: float = DEFAULT_OVERHEAD_TOKENS, per_token: float = 1.0
                 ) -> None:
        self.overhead = overhead
        self.per_token = per_token
        self.verify_extra = 0.0

    def seconds(self, num_tokens: int) -> float:
        return self.overhead + self.per_token * num_tokens


class DecodeStepCost(CostModel):
    """The scheduler's cost of an iteration of decodes and their drafts, for "auto": a
    recency-weighted fit over the iterations it observes, with a knee, deaf to stalls.

    The fit (`seconds`): a hinge t(n) = a + b n + c max(0, n - knee) (b, c >= 0) over the
    recency-weighted mean time of each row count seen (`_bins`; 8 bins an octave past 16
    rows), the knee the row count that fits best; a line (`CostModel`'s, kept as
    `overhead` / `per_token`) until four row counts were seen or where the hinge does not
    fit clearly better (HINGE_GAIN).

    NOTE: why a knee: a decode step of few rows reads the weights once whatever its rows
    (memory-bound), past ~12 rows every row costs its multiplies. Measured in process on
    grounded batch 4 (SmolLM2-135M, Zen 4, 2 cores): 10.6 ms at 4 rows, 13.2 at 12, 20.9 at
    20, 30.8 at 32, 60.8 at 64; the line through them (7.0 ms + 0.82 ms a row) priced the
    drafts of a 4-row step at 0.82 ms (0.33 measured up to the knee), so auto drafted less
    than a fixed 4 where those drafts paid; past the knee both price ~0.9 ms a row, so a
    full batch still drafts nothing.

    NOTE: a pause of the whole process (~330 ms ones in the in-process benchmark's traces,
    against 15 ms steps; a garbage collection; the host taking the core) is no cost of the
    step's tokens, but one such point at a small batch tilts a least-squares line: after one in
    workload W's tail the line turned proportional (no fixed cost: the planner fell back to
    its prior and drafted at 23 sequences), then all fixed cost (drafts looked free), and
    auto drafted where each draft row cost ~0.4 ms for ~0.5 tokens. An iteration slower than
    STALL_FACTOR x the estimate is left out, unless MAX_STALLS come in a row (then the host
    is slower now, and the fit follows it).

    NOTE: an iteration with drafts costs more than one of as many decode rows: SmolLM2 on
    an AMX Xeon, 4 rows: 12.3-12.5 ms with a draft among them, 11.6-11.7 without (the
    verification's sampling and bookkeeping). Priced by rows alone, a draft at 3 sequences
    looked like +3% of the step and was +10%: at free batch 4 auto drafted at 0.36
    acceptance and lost 4% tok/s. `verify_extra` is that difference, over the row counts
    seen both with and without drafts (0 until then; at batch 1 the drafted rows' own
    bins carry it); the hinge is fit to the drafted steps less it.
    """

    def __init__(self, forget: float = 0.98) -> None:
        super().__init__(forget)
        self.stalls_skipped = 0  # observations left out as stalls, since start
        self._slow_in_a_row = 0
        # (bin, drafted) -> [weight, weight x n, weight x t]
        self._bins: dict[tuple[int, bool], list[float]] = {}
        self.hinge: tuple[float, float, float, float] | None = None  # a, b, c, knee
        self.verify_extra = 0.0
        self._since_fit = 0  # observations since the last `refit`
        self._unit = 1.0  # the weight of an observation now, in the bins' units

    def observe(self, num_tokens: int, seconds: float, drafted: bool = False) -> None:
        """An iteration of num_tokens rows (decodes, and drafts if `drafted`) took seconds."""
        if num_tokens <= 0 or not seconds >= 0:
            return
        extra = self.verify_extra if drafted else 0.0
        estimate = self.seconds(num_tokens) + extra
        if not (estimate > 0 and seconds > STALL_FACTOR * estimate):
            self._slow_in_a_row = 0
        else:
            # NOTE: the first MAX_STALLS slow iterations in a row are stalls; from the next
            # one on (until one is not slow) the host is slower, and they count.
            self._slow_in_a_row += 1
            if self._slow_in_a_row <= MAX_STALLS:
                self.stalls_skipped += 1
                return
        super().observe(num_tokens, seconds - extra)
        self._observe_bin(num_tokens, seconds, drafted)
        self._since_fit += 1
        if self._since_fit >= REFIT_EVERY:
            self.refit()

    def refit(self) -> None:
        """Fit the hinge and `verify_extra` to the bins now (`observe` does every
        REFIT_EVERY observations)."""
        self._since_fit = 0
        self._drop_faded()
        self.verify_extra = self._verify_extra()
        self.hinge = fit_hinge(self._points())

    def _observe_bin(self, num_tokens: int, seconds: float, drafted: bool) -> None:
        """Add this observation to its bin, every older one faded by `forget`.

        NOTE: the bins hold sums in units of `_unit` (the weight of an observation now:
        1 / forget per observation since the last `_rescale`), so fading them all is one
        division; what a bin weighs now is its sums[0] / _unit (`_drop_faded`)."""
        self._unit /= self.forget
        if self._unit > MAX_BIN_UNIT:
            self._rescale()
        sums = self._bins.setdefault((row_bin(num_tokens), drafted), [0.0, 0.0, 0.0])
        sums[0] += self._unit
        sums[1] += self._unit * num_tokens
        sums[2] += self._unit * seconds

    def _rescale(self) -> None:
        """Express the bins' sums in today's weights (the unit back to 1)."""
        for sums in self._bins.values():
            sums[:] = [value / self._unit for value in sums]
        self._unit = 1.0

    def _drop_faded(self) -> None:
        """Drop the bins that weigh less than BIN_MIN_WEIGHT now."""
        for key in [k for k, sums in self._bins.items()
                    if sums[0] < BIN_MIN_WEIGHT * self._unit]:
            del self._bins[key]

    def _verify_extra(self) -> float:
        """The mean time a drafted iteration took beyond an undrafted one of the same rows,
        over the bins seen both ways (each weighted by its lighter side; >= 0)."""
        total = weighted = 0.0
        for (key, drafted), (w, _, wt) in self._bins.items():
            plain = self._bins.get((key, False)) if drafted else None
            if plain is not None:
                weight = min(w, plain[0])
                total += weight * (wt / w - plain[2] / plain[0])
                weighted += weight
        return max(0.0, total / weighted) if weighted > 0 else 0.0

    def _points(self) -> list[tuple[float, float, float]]:
        """(weight now, mean rows, mean seconds) per row bin, drafted iterations less
        `verify_extra`."""
        merged: dict[int, list[float]] = {}
        for (key, drafted), (w, wn, wt) in self._bins.items():
            sums = merged.setdefault(key, [0.0, 0.0, 0.0])
            sums[0] += w
            sums[1] += wn
            sums[2] += wt - (w * self.verify_extra if drafted else 0.0)
        return [(w / self._unit, wn / w, wt / w) for w, wn, wt in merged.values()]

    def seconds(self, num_tokens: int) -> float:
        """Estimated time of a decode iteration of num_tokens rows (the hinge, else the
        line; 0 before any observation)."""
        if self.hinge is None:
            return super().seconds(num_tokens)
        a, b, c, knee = self.hinge
        return a + b * num_tokens + c * max(0.0, num_tokens - knee)

    def state(self) -> dict:
        """What it has learnt, JSON-able (`restore` takes it back): the line's sums, the
        bins in today's weights, the hinge, `verify_extra`, and where it is in its refit
        and stall counts (so a restored copy goes on as this one would)."""
        return {"line": list(self._sums),
                "bins": [[key, drafted, *(value / self._unit for value in sums)]
                         for (key, drafted), sums in self._bins.items()],
                "hinge": None if self.hinge is None else list(self.hinge),
                "verify_extra": self.verify_extra, "since_fit": self._since_fit,
                "slow_in_a_row": self._slow_in_a_row}

    def restore(self, state: dict) -> None:
        """Start from a `state()` (e.g. a trace's: a replay plans as the engine did then);
        ValueError naming the field that is malformed, and nothing changed."""
        line = _numbers(state, "line", 5)
        if min(line) < 0 or (line[0] > 0 and line[1] <= 0):
            raise ValueError(f"decode_cost.line: sums >= 0 and, with weight, rows > 0: "
                             f"got {line!r}")
        bins: dict[tuple[int, bool], list[float]] = {}
        for entry in _field(state, "bins", list):
            if not (isinstance(entry, list) and len(entry) == 5 and isinstance(entry[1], bool)
                    and is_int(entry[0]) and entry[0] >= 1):
                raise ValueError(f"decode_cost.bins: expected [rows >= 1, drafted, weight, "
                                 f"weight x rows, weight x seconds], got {entry!r}")
            weight, rows, seconds = _finite(entry[2:], "decode_cost.bins", 3)
            # NOTE: a bin's mean rows is at least 1 (the tolerance: its sums' rounding)
            if weight <= 0 or rows < weight * (1 - 1e-9) or seconds < 0:
                raise ValueError(f"decode_cost.bins: weight > 0, mean rows >= 1 and seconds "
                                 f">= 0: {entry!r}")
            if (entry[0], entry[1]) in bins:
                raise ValueError(f"decode_cost.bins: [{entry[0]}, {entry[1]}] twice")
            bins[(entry[0], entry[1])] = [weight, rows, seconds]
        hinge = state.get("hinge")
        if hinge is not None:
            hinge = tuple(_numbers(state, "hinge", 4))
            if min(hinge) < 0:
                raise ValueError(f"decode_cost.hinge: a, b, c and the knee must be >= 0: "
                                 f"{list(hinge)!r}")
        extra = _finite([state.get("verify_extra")], "verify_extra", 1)[0]
        counts = [count_of(state, name) for name in ("since_fit", "slow_in_a_row")]
        self._sums, self._bins, self.hinge = line, bins, hinge
        self.verify_extra = max(extra, 0.0)
        self._unit, (self._since_fit, self._slow_in_a_row) = 1.0, counts
        self.overhead, self.per_token = 0.0, None
        if line[0] > 0:
            self._fit()


# `Speculator._auto_lengths` looks this many draft increments past its best plan so far (at
# least; one per candidate sequence past that: one more draft for each).
MIN_LOOKAHEAD = 4


def lookahead_window(num_candidates: int) -> int:
    """How many increments past the best plan so far auto looks before it stops."""
    return max(MIN_LOOKAHEAD, num_candidates)


# "auto" drafts only where its plan raises the producing sequences' mean log rate by more
# than this (2%: the step cost and acceptance estimates are off by a few percent).
# Measured: at grounded 16 (past the knee, ~1 ms a row) plans of one draft for each
# sequence in a span, predicted +0.5-1% a sequence, gave tok/s 0.99x and TPOT p99 1.03x;
# at batch 1-4 every plan of the offline replay gained 12% or more.
MIN_PLAN_GAIN = 0.02


# "auto" never plans a step that leaves a candidate's account (`AcceptanceStats.net`: the
# tokens it was expected to gain from speculation so far, in steps: its drafts' expected
# accepted tokens, at its rate when planned, less each step's extra time as a share of the
# step without drafts) below -(ACCOUNT_ALLOWANCE + ACCOUNT_SLACK x its iterations): a
# request may expect to lose a quarter of a step and then 0.3% of its rate to others' drafts
# (SmolLM2 on an AMX Xeon: a row more costs ~5% of a batch-1 step, ~11% of a 4-row one for
# each of the 4). Expected, not accepted: luck alone (one of four sequences at the same
# rate a few drafts behind) would stop every sequence's drafts.
ACCOUNT_ALLOWANCE = 0.25
ACCOUNT_SLACK = 0.003


# `DecodeStepCost`'s bins: exact row counts up to 16, then 8 an octave; a bin whose weight
# faded under BIN_MIN_WEIGHT (~230 iterations at forget 0.98) is dropped. The bins' unit
# is brought back to 1 past MAX_BIN_UNIT (~3,400 observations at 0.98).
BIN_MIN_WEIGHT = 0.01
MAX_BIN_UNIT = 1e30
# The hinge replaces the line only where its weighted squared error is under this share
# of the line's (noise alone bends a line a little at every knee).
HINGE_GAIN = 0.8


def row_bin(num_tokens: int) -> int:
    """The bin of a row count: itself up to 16, then the nearest of 8 an octave."""
    if num_tokens <= 16:
        return num_tokens
    step = 1 << (num_tokens.bit_length() - 4)  # 8 bins an octave
    return step * round(num_tokens / step)


def fit_hinge(points: list[tuple[float, float, float]]
              ) -> tuple[float, float, float, float] | None:
    """The weighted least-squares hinge t = a + b n + c max(0, n - knee) through `points`
    (weight, n, mean t), a, b, c >= 0, the knee at one of the points' n with at least two
    points on each side of it beyond it; (a, b, c, knee) if it fits better than a line by
    HINGE_GAIN, else None (the caller keeps its line).

    NOTE: each candidate knee is solved from the points' sums above it (suffix sums over
    the points sorted by n), so a fit is O(points) (at most ~70 bins).
    """
    if len(points) < 4:
        return None
    points = sorted(points, key=lambda p: p[1])
    total = [0.0] * 6  # w, wn, wnn, wt, wnt, wtt
    for w, n, t in points:
        for i, value in enumerate((w, w * n, w * n * n, w * t, w * n * t, w * t * t)):
            total[i] += value
    s, sn, snn, st, snt, stt = total
    det = s * snn - sn * sn
    if det <= 0:
        return None
    b_line = (s * snt - sn * st) / det
    line_sse = stt - ((st * snn - sn * snt) / det * st + b_line * snt)
    if line_sse <= 1e-9 * (stt - st * st / s):
        return None  # NOTE: the line is exact (up to rounding): nothing to bend
    best, best_sse = None, HINGE_GAIN * max(line_sse, 0.0)
    above = [0.0] * 5  # w, wn, wnn, wt, wnt of the points past the candidate knee
    for index in range(len(points) - 1, 1, -1):
        w, n, t = points[index]
        for i, value in enumerate((w, w * n, w * n * n, w * t, w * n * t)):
            above[i] += value
        if len(points) - index < 2:
            continue
        knee = points[index - 1][1]  # NOTE: two points or more at or below it
        w1, n1, nn1, t1, nt1 = above
        sh, shh = n1 - knee * w1, nn1 - 2 * knee * n1 + knee * knee * w1
        snh, sht = nn1 - knee * n1, nt1 - knee * t1
        beta = _solve3(((s, sn, sh), (sn, snn, snh), (sh, snh, shh)), (st, snt, sht))
        if beta is None or min(beta) < 0 or beta[2] <= 0:
            continue
        sse = stt - (beta[0] * st + beta[1] * snt + beta[2] * sht)
        if sse < best_sse:
            best, best_sse = (*beta, knee), sse
    return best


def _solve3(m, rhs) -> tuple[float, float, float] | None:
    """The solution of the symmetric 3x3 system m x = rhs (by its cofactors; None if near
    singular). NOTE: written out: `fit_hinge` solves one per candidate knee every step."""
    (a, b, c), (_, d, e), (_, _, f) = m
    cof_a, cof_b, cof_c = d * f - e * e, c * e - b * f, b * e - c * d
    cof_d, cof_e, cof_f = a * f - c * c, b * c - a * e, a * d - b * b
    det = a * cof_a + b * cof_b + c * cof_c
    scale = abs(a * d * f)
    if scale <= 0 or abs(det) <= 1e-12 * scale:
        return None
    r0, r1, r2 = rhs
    return ((cof_a * r0 + cof_b * r1 + cof_c * r2) / det,
            (cof_b * r0 + cof_d * r1 + cof_e * r2) / det,
            (cof_c * r0 + cof_e * r1 + cof_f * r2) / det)


FIRST, FRESH, SPAN = "first", "fresh", "span"  # the states of `AcceptanceStats`


@dataclass
class AcceptanceStats:
    """One sequence's record, in three states: its `first` verification (a guess before
    anything is known of it: the engine's pooled rate alone), `fresh` ones (accepted,
    rejections: after a verification that rejected a draft, or an iteration without
    drafts) and those `in_span` (span_accepted, span_rejections: right after a verification
    that accepted every draft, i.e. the sequence is copying a span its proposer follows).

    NOTE: a verification of k drafts that accepts a of them is a successes and, if a < k,
    one failure of a geometric law, so `rate_given` estimates the probability that a draft
    is accepted given that the ones before it were. The states differ several-fold on text
    that copies its input (SmolLM2, the benchmark's grounded prompts: a draft right after a
    fully accepted verification is right ~98% of the time; a first guess at the start of an
    answer that quotes its input nearly as often; a guess after a span ended rarely): one
    record mixing them drafted 8-16 tokens into every guess after a span ended, each such
    verification 2-3x a decode step's time for nothing.
    """

    accepted: int = 0
    rejections: int = 0
    span_accepted: int = 0
    span_rejections: int = 0
    in_span: bool = False
    verifications: int = 0
    # NOTE: the sequence's account ("auto", ACCOUNT_ALLOWANCE): its drafts' expected
    # accepted tokens less, over its iterations, step cost / the step's cost without drafts
    # - 1; `slack` what it may lose.
    net: float = 0.0
    iterations: int = 0

    def slack(self) -> float:
        """How many more steps' time the sequence may lose to speculation (ACCOUNT_SLACK)."""
        return self.net + ACCOUNT_ALLOWANCE + ACCOUNT_SLACK * self.iterations

    @property
    def state(self) -> str:
        """FIRST, FRESH or SPAN: the state the sequence's next drafts are planned in."""
        if self.in_span:
            return SPAN
        if self.verifications == 0 and self.accepted == 0 and self.rejections == 0:
            return FIRST
        return FRESH

    def record(self, verification: tuple[int, int], state: str) -> None:
        """Count a verification (drafts, accepted) planned in `state` (a first one only in
        the pool: the sequence's own record of fresh guesses starts after it)."""
        drafts, accepted = verification
        rejected = int(accepted < drafts)
        self.verifications += 1
        if state == SPAN:
            self.span_accepted += accepted
            self.span_rejections += rejected
        elif state == FRESH:
            self.accepted += accepted
            self.rejections += rejected

    def rate_given(self, prior: float) -> float:
        """The present state's acceptance: its record and, as a prior, PRIOR_WEIGHT drafts
        at `prior` (in a span: one span at `prior`, `span_prior_weight`)."""
        state = self.state
        accepted, rejections = ((self.span_accepted, self.span_rejections) if state == SPAN
                                else (self.accepted, self.rejections) if state == FRESH
                                else (0, 0))
        weight = span_prior_weight(prior) if state == SPAN else PRIOR_WEIGHT
        return (accepted + weight * prior) / (accepted + rejections + weight)


def span_prior_weight(prior: float) -> float:
    """The weight (in drafts) of the pooled prior in a span: one whole span at that rate,
    1 / (1 - prior) drafts ending in one rejection (at most MAX_SPAN_PRIOR_WEIGHT).

    NOTE: a sequence's span record is censored: it counts every accepted draft of the span
    it is in but that span's rejection only once it ends, so against PRIOR_WEIGHT drafts of
    prior a first span's record alone ruled: 40 drafts copied put it at 0.998 (16 drafts
    planned, 15.8 expected) where the engine's spans had shown ~0.96 (10.7 expected); at
    grounded batch 4 three of four sequences then verified 16 drafts at the end of their
    spans and accepted 4 each (a 68-row step, ~7 decodes' time).
    """
    return min(MAX_SPAN_PRIOR_WEIGHT, 1.0 / max(1.0 - prior, 1e-9))


class PooledAcceptance:
    """Every sequence's verifications in each state (FIRST, FRESH, SPAN), each one's weight
    fading by POOL_FORGET per verification since: the prior of a sequence that has shown
    little (`rate`, with a Beta(1, 1) of its own)."""

    def __init__(self) -> None:
        self._counts = {state: [0.0, 0.0] for state in (FIRST, FRESH, SPAN)}

    def observe(self, num_drafts: int, num_accepted: int, state: str) -> None:
        for counts in self._counts.values():
            counts[0] *= POOL_FORGET
            counts[1] *= POOL_FORGET
        counts = self._counts[state]  # accepted, rejections
        counts[0] += num_accepted
        counts[1] += int(num_accepted < num_drafts)

    def rate(self, state: str) -> float:
        accepted, rejections = self._counts[state]
        return (accepted + 1.0) / (accepted + rejections + 2.0)

    def state(self) -> dict:
        """The faded counts per state, JSON-able (`restore` takes them back)."""
        return {name: list(counts) for name, counts in self._counts.items()}

    def restore(self, state: dict) -> None:
        """Start from a `state()`; ValueError naming the state that is malformed."""
        counts = {name: _numbers(state, name, 2) for name in self._counts}
        if any(value < 0 for pair in counts.values() for value in pair):
            raise ValueError(f"pooled: counts must be >= 0, got {counts!r}")
        self._counts = counts


@dataclass(frozen=True)
class Candidate:
    """A running sequence that decodes this iteration and may speculate.

    max_tokens: most drafts it may take (its output and length caps, the config's bound).
    """

    seq_id: str
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    max_tokens: int


def make_proposer(config: SpeculativeConfig) -> Proposer:
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    return SuffixProposer(config.suffix_decoding_max_tree_depth,
                          config.suffix_decoding_max_cached_requests,
                          config.suffix_decoding_max_spec_factor,
                          config.suffix_decoding_min_token_prob)


class Speculator:
    """The speculation state of one engine: the proposer, each sequence's acceptance, totals.

    proposer: default: the config's method. step_cost: the cost model "auto" plans with;
    None: the scheduler passes its own (or `LinearStepCost()` while that knows too little).
    """

    def __init__(self, config: SpeculativeConfig, proposer: Proposer | None = None,
                 step_cost: StepCost | None = None) -> None:
        self.config = config
        self.proposer = proposer if proposer is not None else make_proposer(config)
        self.step_cost = step_cost
        self.stats: dict[str, AcceptanceStats] = {}
        self.pooled = PooledAcceptance()
        self.num_drafts = 0  # verifications (sequences that had drafts), as vLLM counts
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * config.max_tokens
        self.explorations = 0  # "auto" plans made on the prior after EXPLORE_AFTER dry ones
        # "auto": iterations in a row that planned nothing on a fitted cost (EXPLORE_AFTER)
        self.dry_iterations = 0

    # ----------------------------------------------------------------- planning
    def plan(self, candidates: list[Candidate], budget: int, planned_tokens: int,
             producing: int, cost: StepCost | None = None) -> dict[str, list[int]]:
        """Draft tokens per sequence id (only those with some), within `budget` tokens.

        planned_tokens: tokens of the step the drafts are priced against (the scheduler
        passes its decodes': a prefill chunk beside them is work done anyway); producing:
        sequences that will sample a token in it (decodes and last prefill chunks); cost:
        the scheduler's step cost model (used when this speculator has none of its own).
        """
        if budget <= 0 or not candidates:
            return {}
        cost = self.step_cost or cost
        proposals: dict[str, list[int]] = {}  # "auto": asked while planning
        if self.config.auto:
            wanted = self._auto_wanted(candidates, budget, planned_tokens, producing, cost,
                                       proposals)
        else:
            wanted = {c.seq_id: min(c.max_tokens, self.config.max_tokens) for c in candidates}
        drafts: dict[str, list[int]] = {}
        for cand in candidates:
            k = min(wanted.get(cand.seq_id, 0), budget)
            if k <= 0:
                continue
            tokens = (proposals[cand.seq_id] if cand.seq_id in proposals else
                      self.proposer.propose(cand.seq_id, cand.prompt_ids, cand.output_ids, k))
            if tokens:
                drafts[cand.seq_id] = tokens[:k]
                budget -= len(drafts[cand.seq_id])
        if self.config.auto:
            self._charge(candidates, drafts, planned_tokens, cost or LinearStepCost())
        self._end_spans(candidates, drafts)
        return drafts

    def _charge(self, candidates: list[Candidate], drafts: dict[str, list[int]],
                planned_tokens: int, cost: StepCost) -> None:
        """Each candidate's account: its drafts' expected accepted tokens (at its rate now)
        less the step's slowdown from all the drafts; and one iteration more."""
        slowdown = _slowdown(cost, max(planned_tokens, 1), sum(map(len, drafts.values())))
        for cand in candidates:
            own = len(drafts.get(cand.seq_id, ()))
            gained = expected_tokens(self.rate(cand.seq_id), own) - 1.0 if own else 0.0
            stats = self.stats.setdefault(cand.seq_id, AcceptanceStats())
            stats.net += gained - slowdown
            stats.iterations += 1

    def _auto_wanted(self, candidates: list[Candidate], budget: int, planned_tokens: int,
                     producing: int, cost: StepCost | None,
                     proposals: dict[str, list[int]]) -> dict[str, int]:
        """"auto"'s plan on `cost` (None: the prior, `LinearStepCost()`); after
        EXPLORE_AFTER iterations in a row that planned nothing on a fitted cost, the plan on
        the prior, cut to one draft for its sequence of the highest rate (`explorations`
        counts them): the price of a draft row is learnt from one row.

        NOTE: a fitted cost learns what a draft row costs only from steps that had drafts.
        One that prices them too dear from decodes alone (a line through a few slow steps of
        2 sequences during a warm-up: 2 rows at 1.5x a 1-row step) plans none, so it never
        sees one and stays wrong: a benchmark run at grounded batch 1 drafted nothing for
        ~430 iterations (1.01x off, 2.2x with fixed 4) until the warm-up's steps had faded.
        An exploration costs one row every EXPLORE_AFTER iterations at most (a 16-row step
        priced on the prior would give each of 16 guessing sequences one, ~1.9x the step);
        where the step is compute-bound (64 sequences) the prior plans nothing either.
        """
        if cost is None:
            return self._proposed_lengths(candidates, budget, planned_tokens, producing,
                                          LinearStepCost(), proposals)
        wanted = self._proposed_lengths(candidates, budget, planned_tokens, producing, cost,
                                        proposals)
        if wanted:
            self.dry_iterations = 0
            return wanted
        self.dry_iterations += 1
        if self.dry_iterations < EXPLORE_AFTER:
            return wanted
        self.dry_iterations = 0
        prior = self._proposed_lengths(candidates, budget, planned_tokens, producing,
                                       LinearStepCost(), proposals)
        if not prior:
            return wanted
        best = max(prior, key=self.rate)  # NOTE: ties: the first in candidate order
        explorer = next(i for i, c in enumerate(candidates) if c.seq_id == best)
        if not _within_accounts([self._slack(c.seq_id) for c in candidates],
                                {explorer: expected_tokens(self.rate(best), 1)},
                                _slowdown(cost, max(planned_tokens, 1), 1)):
            return wanted  # NOTE: the row would cost some sequence more than it has
        self.explorations += 1
        return {best: 1}

    def _proposed_lengths(self, candidates: list[Candidate], budget: int,
                          planned_tokens: int, producing: int, cost: StepCost,
                          proposals: dict[str, list[int]]) -> dict[str, int]:
        """`_auto_lengths` within what the proposer has: the sequences a plan gives drafts
        are asked (each once, for as many as it may take: `proposals` keeps them); where
        one has fewer than planned, the plan is made again with each asked sequence capped
        at its proposal (at most PROPOSAL_ROUNDS plans).

        NOTE: a plan is priced as a whole: 16 sequences copying at ~0.93 on a 16-row step
        (~1 ms a row past the knee) paid only if all 16 drafted one (16 x log1p(0.93) =
        10.5 against 16 x log(30.4 / 16.1) = 10.2); the proposer had drafts for 8 of
        them, and the 24-row step slowed all 16 for 7.4 expected tokens (grounded 16,
        in the benchmark's flow: 456 drafts in a run where the others had 60-70).
        """
        wanted: dict[str, int] = {}
        for _ in range(PROPOSAL_ROUNDS):
            capped = [replace(c, max_tokens=min(c.max_tokens, len(proposals[c.seq_id])))
                      if c.seq_id in proposals else c for c in candidates]
            wanted = self._auto_lengths(capped, budget, planned_tokens, producing, cost)
            short = False
            for cand in candidates:
                k = wanted.get(cand.seq_id, 0)
                if k and cand.seq_id not in proposals:
                    proposals[cand.seq_id] = self.proposer.propose(
                        cand.seq_id, cand.prompt_ids, cand.output_ids,
                        min(cand.max_tokens, self.config.max_tokens))
                short = short or k > len(proposals.get(cand.seq_id, ()))
            if not short:
                return wanted
        return {seq_id: min(k, len(proposals[seq_id])) for seq_id, k in wanted.items()
                if proposals.get(seq_id)}

    def _end_spans(self, candidates: list[Candidate], drafts: dict[str, list[int]]) -> None:
        """A decoding sequence without drafts this iteration is no longer in a span: it
        decodes a token of its own, so its next drafts are a fresh guess."""
        for cand in candidates:
            stats = self.stats.get(cand.seq_id)
            if stats is not None and stats.in_span and cand.seq_id not in drafts:
                stats.in_span = False

    def _auto_lengths(self, candidates: list[Candidate], budget: int, planned_tokens: int,
                      producing: int, cost: StepCost) -> dict[str, int]:
        """Each sequence's draft count maximising the sum over the step's producing
        sequences of log(the sequence's expected tokens / step cost), i.e. the geometric
        mean of their token rates: increments are taken best gain first (a sequence's j-th
        draft raises its log tokens by log1p(rate^j / its expected tokens so far); ties in
        candidate order), and the plan is the prefix of them with the highest sum. The walk
        stops when `lookahead_window` increments in a row found no higher sum.

        NOTE: why not stop at the first increment that does not pay (the rule until
        2026-12-05, afternoon): one more row costs every sequence of the step
        log(cost(n + 1) / cost(n)), less the larger the step, so one draft more for each
        sequence can pay where one draft more for one does not. At grounded batch 4 on a
        knee-shaped cost (SmolLM2, Zen 4: 13.0 ms at 12 rows, ~0.95 ms a row past them)
        four sequences copying at ~0.96 stopped at 2 drafts each (the third's gain 0.27
        against 4 x log(13.95 / 13.0) = 0.28) where 3 each raise the sum (1.08 against
        1.02). The window (one increment per sequence, at least MIN_LOOKAHEAD) misses
        plans several rounds further on: 4 sequences at 0.98 on that cost get 3 drafts
        each where 7 each is best by ~3% of each one's rate (a longer window costs a walk
        of up to 16 increments a sequence at 64 slots, where nothing pays).

        NOTE: why not the sum of tokens over the step cost (the rule until 2026-12-05): a
        draft row slows every sequence in the step, and that rule charged it to the step's
        total, so sequences in a span took all the drafts: at batch 4 of the grounded
        prompts two copying sequences drafted 16 each (36-row steps of ~39 ms against
        9.4 ms decodes) while the other two, not yet copying, got none and ran at a quarter
        of their speed, and the run ended on their tail (auto 0.87x of fixed length 4).
        With one producing sequence the two rules are the same. A heap holds each
        sequence's next increment only, so an iteration where no draft pays (a full batch:
        the usual case at 64 slots) costs a look at each sequence's rate and the window.
        """
        heap = []
        for index, cand in enumerate(candidates):
            rate, limit = self.rate(cand.seq_id), min(cand.max_tokens, self.config.max_tokens)
            if limit > 0:
                heap.append((-math.log1p(rate), index, 1, rate, limit, 1.0))
        heapq.heapify(heap)
        tokens = max(planned_tokens, 1)
        weight = float(max(producing, 1))  # NOTE: each producing sequence feels the step
        seconds = start_seconds = cost.seconds(tokens)
        slacks: list[float] | None = None  # NOTE: looked up at the first paying prefix
        produced_by: dict[int, float] = {}  # candidate index -> its expected tokens
        window = lookahead_window(len(heap))
        taken: list[int] = []  # candidate index of each increment, in order
        total = best = 0.0  # the sum's change from no drafts: now, and at the best prefix
        best_length = 0
        while heap and budget > 0 and len(taken) - best_length < window:
            negative_gain, index, j, rate, limit, produced = heapq.heappop(heap)
            more = cost.seconds(tokens + 1) + cost.verify_extra
            if not (seconds > 0 and more > 0):
                break
            total += -negative_gain - weight * math.log(more / seconds)
            tokens, seconds = tokens + 1, more
            produced += rate ** j
            produced_by[index] = produced
            taken.append(index)
            budget -= 1
            if total > best + 1e-12:
                if slacks is None:
                    slacks = [self._slack(cand.seq_id) for cand in candidates]
                if _within_accounts(slacks, produced_by, seconds / start_seconds - 1.0):
                    best, best_length = total, len(taken)
            if j < limit:
                gain = math.log1p(rate ** (j + 1) / produced)
                heapq.heappush(heap, (-gain, index, j + 1, rate, limit, produced))
        wanted: dict[str, int] = {}
        if best <= MIN_PLAN_GAIN * weight:
            return wanted  # NOTE: within the estimates' error: as likely a loss
        for index in taken[:best_length]:
            seq_id = candidates[index].seq_id
            wanted[seq_id] = wanted.get(seq_id, 0) + 1
        return wanted

    def _slack(self, seq_id: str) -> float:
        stats = self.stats.get(seq_id)
        return stats.slack() if stats is not None else ACCOUNT_ALLOWANCE

    def rate(self, seq_id: str) -> float:
        """A sequence's per-draft acceptance in its present state (first, fresh or in a
        span): its own record, the pooled rate of that state as the prior."""
        stats = self.stats.get(seq_id)
        own = stats if stats is not None else AcceptanceStats()
        return own.rate_given(self.pooled.rate(own.state))

    # ----------------------------------------------------------------- outcomes
    def observe(self, seq_id: str, num_drafts: int, num_accepted: int) -> None:
        """A verification of num_drafts drafts accepted the first num_accepted."""
        if num_drafts <= 0:
            return
        stats = self.stats.setdefault(seq_id, AcceptanceStats())
        state = stats.state
        stats.record((num_drafts, num_accepted), state)
        self.pooled.observe(num_drafts, num_accepted, state)
        # NOTE: the state of the next drafts: in a span while every draft was accepted
        stats.in_span = num_accepted == num_drafts
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for position in range(min(num_accepted, len(self.accepted_per_position))):
            self.accepted_per_position[position] += 1

    def finish(self, seq_id: str, output_ids: Sequence[int], completed: bool) -> None:
        """The sequence left; completed (stop or length): its output may serve others."""
        self.stats.pop(seq_id, None)
        if completed:
            self.proposer.finish(seq_id, output_ids)
        else:
            self.proposer.forget(seq_id)

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens since start (0.0 before any)."""
        return (self.num_accepted_tokens / self.num_draft_tokens
                if self.num_draft_tokens else 0.0)


def count_of(state: dict, name: str) -> int:
    """state[name] (0 if absent) as an integer >= 0; ValueError naming it otherwise."""
    value = state.get(name, 0)
    if not is_int(value) or value < 0:
        raise ValueError(f"planner state: {name!r} must be an integer >= 0, got {value!r}")
    return value


def _field(state: dict, name: str, kind: type):
    if not isinstance(state, dict) or not isinstance(state.get(name), kind):
        raise ValueError(f"planner state: {name!r} must be a {kind.__name__}")
    return state[name]


def _numbers(state: dict, name: str, count: int) -> list[float]:
    """state[name] as `count` finite floats; ValueError naming it otherwise."""
    return _finite(_field(state, name, list), name, count)


def _finite(values: list, name: str, count: int) -> list[float]:
    if len(values) != count or not all(is_finite_number(v) for v in values):
        raise ValueError(f"planner state: {name!r} must be {count} finite numbers, "
                         f"got {values!r}")
    return [float(v) for v in values]


def _slowdown(cost: StepCost, tokens: int, more: int) -> float:
    """cost of `tokens` + `more` rows / cost of `tokens` - 1: the share of a step each of its
    sequences waits longer for `more` draft rows (0 where the cost is not positive)."""
    base, grown = cost.seconds(tokens), cost.seconds(tokens + more) + cost.verify_extra
    return grown / base - 1.0 if more > 0 and base > 0 and grown > 0 else 0.0


def _within_accounts(slacks: list[float], produced_by: dict[int, float],
                     slowdown: float) -> bool:
    """Whether a plan leaves every candidate's account (`AcceptanceStats.slack`) >= 0: the
    step's slowdown against each one's expected accepted drafts (none for those without)."""
    return all(slack + produced_by.get(index, 1.0) - 1.0 >= slowdown
               for index, slack in enumerate(slacks))


def expected_tokens(rate: float, k: int) -> float:
    """Expected tokens of a verification of k drafts at per-draft acceptance `rate` (the
    accepted drafts plus the one token sampled after them)."""
    if k <= 0:
        return 1.0
    if math.isclose(rate, 1.0):
        return k + 1.0
    return (1 - rate ** (k + 1)) / (1 - rate)
