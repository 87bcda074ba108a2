"""Cost models: how long one iteration takes, as a function of what the scheduler planned.

An iteration's plan (a `SchedulerOutput`) is reduced to `StepFeatures`:

- prefill_tokens: tokens of prefill chunks (rows through every linear layer);
- decode_seqs: sequences decoding one token (rows too, but also one KV read each);
- attention_pairs: query-key pairs the attention computes: a chunk of n tokens starting at
  position s attends to s+1 .. s+n positions, n*s + n(n+1)/2 pairs (a decode: its context);
- sampled_rows: rows that go through the LM head and the sampler;
- chunks: sequences the attention takes one at a time, in an iteration that does not run
  on the decode stack (`core.outputs.runs_as_rows`: prefill chunks, and verifications
  beside them): one call per chunk and layer (`attention.torch_paged.paged_attention`'s
  prefills), so such an iteration of many prompts costs more than its tokens and pairs say
  (W's burst at 64 slots, SmolLM2 on a 2-core AMX Xeon, before short chunks ran as rows:
  40 chunks of 287 tokens took 172 ms where a fit without them gave 97).
- decode_pairs: a part of attention_pairs, a decode's first row's (its context): read from
  the KV cache, where a prefill chunk's pairs are computed on keys it has just written or
  that its other rows share. A decode's pairs are memory reads and dearer (SmolLM2 on the
  2-core AMX Xeon: ~1.5 us a pair against ~0.6 for a prefill's); priced at one price, a
  64-row decode step came out ~15% dear at short contexts and cheap at long ones. Its
  coefficient is what a decode's pair costs beyond `attention_pairs`' (0 when it is not
  dearer, or in a profile fit before it: LATER_FEATURES).
- first_forward: 1 in an engine's first forward: its one-time costs (the KV pool's first
  pages faulted in, state built on first use). SmolLM2 on the 2-core AMX Xeon: a fresh
  engine's first 42-token prefill took 45-50 ms where the next one took 30-37; W's burst at
  64 slots pays it in every request's TTFT, so a replay without it came out ~10% short
  there. `slotserve calibrate` measures it on each grid point's fresh engine.
- mixed_decodes: a part of decode_seqs, the one-token decodes of an iteration off the
  decode stack. Beside a longer prefill chunk the runner takes its general path (a call per
  layer and op) instead of the C++ decode stack's one call for all layers, so each such
  decode costs more than a decode among decodes only (SmolLM2 on the 2-core AMX Xeon:
  0.09-0.11 ms on top, three calibrations; W at 16 slots, whose new prompts join 15
  decodes, replayed at x1.11 the measured tok/s without it, x1.07 with it). Its
  coefficient is that price on top of decode_seqs'; `slotserve calibrate` makes such
  iterations at each grid point (`calibrate._run_mixed`).

A decode verified with k draft tokens (speculative decoding) has 1 + k rows with logits at
each: 1 + k sampled rows and its attention pairs. In an iteration of decodes and short
prefill chunks only (`core.outputs.runs_as_rows`), the runner computes every token as a
decode row of the C++ decode stack (each reads its sequence's KV up to its own position:
`attention.metadata._one_decode_group`), so the k drafts, and a short chunk's tokens, count
as decode rows (`decode_seqs`); otherwise the iteration takes the general path, where the
verification is a chunk of 1 + k tokens: one decode sequence and k prefill tokens.

`LinearCost` charges seconds = base + sum(coefficient x feature), fit per machine, model
and kernel set by least squares (`LinearCost.fit`, numpy); `slotserve calibrate` measures
the samples and writes the profile file (`save` / `load_profile`). `UnitCost` is the seed's
toy clock: every iteration takes one unit, whatever it does.

A knee (`LinearCost.knee`, optional): rows through the linear layers (`StepFeatures.rows`:
prefill tokens + decode rows) past `knee` cost `rows_past_knee` seconds each on top. A step
of few rows is memory-bound (it reads every weight once, however many rows: a row more
costs little) and one of many is compute-bound (every row costs its multiplies), so the
cost of a step against its rows bends upwards where the one turns into the other; a line
through both regimes prices a small step's extra rows (a batch-1 verification's drafts) at
the large steps' slope. `LinearCost.fit(samples, knee="auto")` picks the knee that fits
best (or none).

Draft pairs (`StepFeatures.draft_pairs`, optional coefficient `LinearCost.DRAFT_PAIRS`): of
a verification's (or a short prefill chunk's) attention pairs in an iteration on the decode
stack, those of its rows after the first. The decode stack computes each row's attention
over the sequence's KV up to its own position, so the drafted rows read the KV the first
row has just brought into cache: their pairs cost compute, not a read from memory (this
2-core host, free text and W: ~0.3-0.8 us a pair against ~1.7-1.9 us for a decode's).
Priced at the attention coefficient a batch-1 verification of 8 drafts over a 170-token
context cost 1.4x a decode in the replay where it measured ~1.05x. An off run has no
drafts (and few short chunks beside decodes), so its iterations cannot tell the two prices
apart: `LinearCost.fit_draft_pairs` fits the drafted rows' price on runs with speculation
(each run's own speed factored out); without it they cost `attention_pairs`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from slotserve.config import SlotKind
from slotserve.core.outputs import SchedulerOutput, runs_as_rows
from slotserve.value_checks import is_finite_number, is_int

PROFILE_VERSION = 1
FEATURES = ("prefill_tokens", "decode_seqs", "attention_pairs", "sampled_rows", "chunks",
            "decode_pairs", "first_forward", "mixed_decodes")
# NOTE: profiles fit before `chunks`, `decode_pairs`, `first_forward` or `mixed_decodes` was
# a feature lack it: a LinearCost without it has it at 0 (its cost then sits in the other
# coefficients, as it did when they were fit).
LATER_FEATURES = ("chunks", "decode_pairs", "first_forward", "mixed_decodes")
KNEE_COEFFICIENT = "rows_past_knee"  # seconds per row past the knee (see the docstring)
DRAFT_PAIRS = "draft_pairs"  # seconds per query-key pair of a drafted row (the docstring)
MIN_DRAFT_SAMPLES = 5  # verifications `fit_draft_pairs` needs
MAX_KNEE_CANDIDATES = 48  # knees `fit(knee="auto")` tries first: the samples' row counts
KNEE_REFINE = 8  # then this many more on each side of the best, between its neighbours,
KNEE_REFINE_LEVELS = 3  # on grids this many times finer and finer,
KNEE_SEEDS = 2  # around each of this many best knees of the first grid


@dataclass(frozen=True)
class StepFeatures:
    """What one iteration computes (see the module docstring)."""

    prefill_tokens: int = 0
    decode_seqs: int = 0
    attention_pairs: int = 0
    sampled_rows: int = 0
    # NOTE: a part of attention_pairs (a verification's or short chunk's rows after its
    # first, on the decode stack): priced on its own only with a DRAFT_PAIRS coefficient.
    draft_pairs: int = 0
    chunks: int = 0
    # NOTE: a part of attention_pairs too (decodes' first rows); its coefficient is a
    # price on top of attention_pairs'.
    decode_pairs: int = 0
    first_forward: int = 0
    # NOTE: a part of decode_seqs (one-token decodes beside a prefill chunk); its
    # coefficient is a price on top of decode_seqs'.
    mixed_decodes: int = 0

    @classmethod
    def of(cls, plan: SchedulerOutput, first_forward: bool = False) -> StepFeatures:
        """The features of a plan; first_forward: the engine's first forward (the runner
        knows, the plan does not)."""
        prefill = decode = pairs = sampled = drafted = chunks = decode_pairs = mixed = 0
        # NOTE: as the runner's fused CPU path decides (`runs_as_rows`): every token a decode
        # row on the decode stack, or the general path (chunks attended one at a time)
        on_stack = runs_as_rows(plan.seqs)
        for seq in plan.seqs:
            chunks += not (on_stack or seq.is_one_token_decode)
            mixed += not on_stack and seq.is_one_token_decode
            n, start = seq.num_tokens, seq.start_pos
            drafts = len(seq.spec_token_ids)
            chunk_pairs = n * start + n * (n + 1) // 2
            if on_stack:
                # NOTE: a verification's or a short prompt chunk's rows after its first
                # re-read the KV its first row has just read (drafted pairs)
                decode += n
                decode_pairs += start + 1
                drafted += chunk_pairs - (start + 1)
            elif seq.kind == SlotKind.DECODE:  # beside a prefill: drafts are chunk rows
                decode += 1
                prefill += drafts
                decode_pairs += start + 1
            else:
                prefill += n
            pairs += chunk_pairs
            sampled += seq.sample + drafts
        return cls(prefill, decode, pairs, sampled, drafted, chunks, decode_pairs,
                   int(first_forward), mixed)

    @property
    def rows(self) -> int:
        """Rows through every linear layer: prefill tokens and decode rows."""
        return self.prefill_tokens + self.decode_seqs

    def vector(self, knee: float | None = None) -> list[float]:
        """[1, features...]: the row of the least-squares design matrix; with a knee, then
        the rows past it."""
        row = [1.0, *(float(getattr(self, name)) for name in FEATURES)]
        return row if knee is None else [*row, float(max(0.0, self.rows - knee))]


class UnitCost:
    """The seed's toy clock: one unit of time per iteration."""

    name = "unit"

    def step_seconds(self, features: StepFeatures) -> float:
        return 1.0

    def describe(self) -> dict:
        return {"kind": "unit"}


@dataclass
class LinearCost:
    """seconds = base + sum(coefficients[f] * feature f), plus, with a knee,
    coefficients["rows_past_knee"] * max(0, rows - knee) (the module docstring); `meta`
    says where it was fit."""

    base: float
    coefficients: dict[str, float]
    meta: dict = field(default_factory=dict)
    knee: float | None = None
    name = "linear"

    def __post_init__(self) -> None:
        self.coefficients = {**dict.fromkeys(LATER_FEATURES, 0.0), **self.coefficients}
        missing = set(FEATURES) - set(self.coefficients)
        if missing:
            raise ValueError(f"coefficients is missing {sorted(missing)}")
        unknown = set(self.coefficients) - {*FEATURES, KNEE_COEFFICIENT, DRAFT_PAIRS}
        if unknown:
            raise ValueError(f"coefficients has unknown {sorted(unknown)}")
        for key, value in [("base", self.base), *self.coefficients.items()]:
            if not is_finite_number(value):
                raise ValueError(f"coefficient {key} must be a finite number, got {value!r}")
        if self.knee is None:
            if KNEE_COEFFICIENT in self.coefficients:
                raise ValueError(f"coefficient {KNEE_COEFFICIENT} needs a knee (rows)")
            return
        if not is_finite_number(self.knee) or self.knee < 0:
            raise ValueError(f"knee must be a finite number of rows >= 0, got {self.knee!r}")
        if KNEE_COEFFICIENT not in self.coefficients:
            raise ValueError(f"coefficients is missing {KNEE_COEFFICIENT!r} (knee is set)")

    def step_seconds(self, features: StepFeatures) -> float:
        seconds = self.base + sum(self.coefficients[f] * getattr(features, f) for f in FEATURES)
        if DRAFT_PAIRS in self.coefficients:
            seconds += features.draft_pairs * (self.coefficients[DRAFT_PAIRS]
                                               - self.coefficients["attention_pairs"])
        if self.knee is not None:
            seconds += self.coefficients[KNEE_COEFFICIENT] * max(0.0, features.rows - self.knee)
        # NOTE: a fit may give a small negative coefficient; time never runs backwards.
        return max(seconds, 0.0)

    @classmethod
    def fit(cls, samples: list[tuple[StepFeatures, float]], relative: bool = True,
            nonnegative: bool = True, meta: dict | None = None,
            knee: float | str | None = None, groups: list[int] | None = None) -> LinearCost:
        """Least squares over (features, measured seconds) samples.

        relative: weight each sample by 1/seconds, so a 10 ms step's error counts as much
        as a 1 s step's in proportion (minimises relative, not absolute, error).
        nonnegative: no feature may make an iteration cheaper. Features are collinear in
        practice (every decode sequence is also a sampled row), and noise then gives one a
        large negative coefficient and its twin a large positive one; a feature whose
        coefficient comes out negative is dropped (held at 0) and the rest refit, until
        none is negative.
        knee: None: a plain linear fit; a number: rows past it get their own coefficient
        (`rows_past_knee`); "auto": the knee that fits best (least weighted squared error:
        `_best_knee`), or none if no knee fits better than the line.
        groups: each sample's run (0, 1, ...); if given, each run has a base of its own (the
        host's speed then, a workload's cost per step that no feature sees) and the other
        coefficients are shared: the returned base is the median of the runs' (each in
        meta["run_bases"]), to be moved to a run's own level (`spec_prediction.anchored`).
        NOTE: one base for runs whose fixed costs differ makes the features explain the
        difference (a fit over free text and grounded answers, the second 2 ms a step
        dearer, doubled the attention price and lost the knee).
        """
        if len(samples) < len(FEATURES) + 1:
            raise ValueError(f"samples: need at least {len(FEATURES) + 1} to fit "
                             f"{len(FEATURES) + 1} coefficients, got {len(samples)}")
        y = np.array([s for _, s in samples], dtype=float)
        if not np.all(y > 0):
            raise ValueError("samples: measured seconds must be > 0")
        w = 1.0 / y if relative else np.ones_like(y)
        features = [f for f, _ in samples]
        if groups is not None and len(groups) != len(samples):
            raise ValueError(f"groups: {len(groups)} for {len(samples)} samples")
        onehot = None if groups is None else _one_hot(groups)
        if knee == "auto":
            _, knee, coef = _best_knee(features, y, w, nonnegative, onehot)
        elif knee is None or is_int(knee) or isinstance(knee, float):
            _, coef = _fit_at(features, y, w, nonnegative, knee, onehot)
        else:
            raise ValueError(f"knee must be None, a number of rows or 'auto', got {knee!r}")
        meta = dict(meta or {})
        bases = [float(coef[0])]
        if onehot is not None:
            bases, coef = [float(b) for b in coef[:onehot.shape[1]]], coef[onehot.shape[1] - 1:]
            meta["run_bases"] = bases
        names = FEATURES if knee is None else (*FEATURES, KNEE_COEFFICIENT)
        return cls(float(np.median(bases)), {f: float(c) for f, c in zip(names, coef[1:])},
                   meta, None if knee is None else float(knee))

    def fit_draft_pairs(self, runs: list[list[tuple[StepFeatures, float]]]) -> LinearCost:
        """This model with a DRAFT_PAIRS coefficient fit on runs with speculation (each a
        list of (features, seconds): one run's iterations); the rest as it is.

        Each run's speed is its own (a host shared with other work slows whole runs): a
        run's factor is the median of measured / predicted over its iterations without
        drafts, and its verifications' seconds are divided by it. A verification's drafted
        pairs then cost what its seconds have beyond the model's price of the rest; the
        coefficient is the median of that per pair over every verification, weighted by
        its drafted pairs (a stall of the process is one outlier, not a shift), and never
        below 0. ValueError with fewer than MIN_DRAFT_SAMPLES verifications.
        """
        rest = LinearCost(self.base, {**self.coefficients, DRAFT_PAIRS: 0.0}, self.meta,
                          self.knee)
        per_pair: list[tuple[float, float]] = []  # (seconds a drafted pair, its weight)
        for run in runs:
            speed = _run_speed(rest, run)
            per_pair += [((seconds / speed - rest.step_seconds(f)) / f.draft_pairs,
                          float(f.draft_pairs)) for f, seconds in run if f.draft_pairs > 0]
        if len(per_pair) < MIN_DRAFT_SAMPLES:
            raise ValueError(f"runs: need at least {MIN_DRAFT_SAMPLES} verifications among "
                             f"decodes to price drafted rows, got {len(per_pair)}")
        price = max(0.0, _weighted_median(per_pair))
        return LinearCost(self.base, {**self.coefficients, DRAFT_PAIRS: price},
                          dict(self.meta), self.knee)

    def residuals(self, samples: list[tuple[StepFeatures, float]]) -> dict:
        """How well this model predicts the samples: RMS (ms) and relative errors."""
        measured = np.array([s for _, s in samples], dtype=float)
        predicted = np.array([self.step_seconds(f) for f, _ in samples])
        rel = np.abs(predicted - measured) / measured
        return {"samples": len(samples),
                "rms_ms": float(np.sqrt(np.mean((predicted - measured) ** 2)) * 1000),
                "median_rel_error": float(np.median(rel)),
                "p90_rel_error": float(np.percentile(rel, 90)),
                "max_rel_error": float(rel.max()),
                "total_rel_error": float(abs(predicted.sum() - measured.sum())
                                         / measured.sum())}

    def describe(self) -> dict:
        return {"kind": "linear", "base": self.base, "coefficients": dict(self.coefficients),
                **({"knee": self.knee} if self.knee is not None else {}),
                **({"model": self.meta["model"]} if "model" in self.meta else {})}

    def to_profile(self) -> dict:
        return {"version": PROFILE_VERSION, "kind": "linear", "base": self.base,
                "coefficients": dict(self.coefficients),
                **({"knee": self.knee} if self.knee is not None else {}), "meta": self.meta}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_profile(), indent=1) + "\n")

    def format(self) -> str:
        """The fit in one line per coefficient, in readable units."""
        lines = [f"  base            {self.base * 1000:10.3f} ms per iteration"]
        units = {"prefill_tokens": "ms per prefill token", "decode_seqs": "ms per decode seq",
                 "attention_pairs": "ms per 1k query-key pairs",
                 "sampled_rows": "ms per sampled row",
                 "chunks": "ms per chunk (prefill, or verification beside one)",
                 "decode_pairs": "ms per 1k decodes' query-key pairs, on top",
                 "first_forward": "ms more in an engine's first forward",
                 "mixed_decodes": "ms per decode beside a prefill chunk, on top"}
        for f in FEATURES:
            scale = 1e6 if f.endswith("_pairs") else 1000
            lines.append(f"  {f:<16}{self.coefficients[f] * scale:10.4f} {units[f]}")
        if DRAFT_PAIRS in self.coefficients:
            drafted = self.coefficients[DRAFT_PAIRS] * 1e6
            lines.append(f"  {DRAFT_PAIRS:<16}{drafted:10.4f} ms per 1k query-key pairs of "
                         "drafted rows (decodes only)")
        if self.knee is not None:
            past = self.coefficients[KNEE_COEFFICIENT] * 1000
            lines.append(f"  {KNEE_COEFFICIENT:<16}{past:10.4f} ms per row past {self.knee:g} "
                         "rows (prefill tokens + decode rows)")
        return "\n".join(lines)


def _run_speed(model: LinearCost, run: list[tuple[StepFeatures, float]]) -> float:
    """The median of measured / predicted seconds over a run's iterations without drafts
    (1.0 if it has none the model prices above 0)."""
    ratios = [seconds / model.step_seconds(f) for f, seconds in run
              if f.draft_pairs == 0 and model.step_seconds(f) > 0]
    return float(np.median(ratios)) if ratios else 1.0


def _weighted_median(values: list[tuple[float, float]]) -> float:
    """The value at half the total weight of (value, weight) pairs."""
    ordered = sorted(values)
    half, running = sum(w for _, w in ordered) / 2, 0.0
    for value, weight in ordered:
        running += weight
        if running >= half:
            return value
    return ordered[-1][0]


def _one_hot(groups: list[int]) -> np.ndarray:
    """[samples, runs]: 1 where a sample belongs to a run (the runs' base columns)."""
    runs = {g: i for i, g in enumerate(dict.fromkeys(groups))}
    onehot = np.zeros((len(groups), len(runs)))
    onehot[np.arange(len(groups)), [runs[g] for g in groups]] = 1.0
    return onehot


def _fit_at(features: list[StepFeatures], y: np.ndarray, w: np.ndarray, nonnegative: bool,
            knee: float | None, onehot: np.ndarray | None = None
            ) -> tuple[float, np.ndarray]:
    """(weighted squared error, coefficients) of the fit with this knee (None: the line);
    with onehot (`_one_hot`), a base per run: the coefficients start with the runs' bases
    instead of one."""
    x = np.array([f.vector(knee) for f in features])
    if onehot is not None:
        x = np.hstack([onehot, x[:, 1:]])
    bases = 1 if onehot is None else onehot.shape[1]
    coef = _least_squares(x * w[:, None], y * w, nonnegative, bases)
    return float(np.sum(((x @ coef - y) * w) ** 2)), coef


def _best_knee(features: list[StepFeatures], y: np.ndarray, w: np.ndarray,
               nonnegative: bool, onehot: np.ndarray | None = None
               ) -> tuple[float, float | None, np.ndarray]:
    """(error, knee, coefficients) of the best fit: the line, or a knee among the samples'
    row counts (at most MAX_KNEE_CANDIDATES of them, below the largest: a knee past every
    sample is the line), then refined KNEE_REFINE_LEVELS times on a finer grid between the
    neighbours of each of the KNEE_SEEDS best (a knee between two row counts fits
    differently from both).

    NOTE: the knee's two parameters (where, and its coefficient) must pay for themselves as
    the Bayesian information criterion counts them: its error must be below the line's by
    a factor n^(2/n) for n samples (13% at 50 samples, 0.8% at 2000), so a line with noise
    (or the rounding of a trace's times) stays a line.
    """
    error, coef = _fit_at(features, y, w, nonnegative, None, onehot)
    line: tuple[float, float | None, np.ndarray] = (error, None, coef)
    floor = 1e-12 * float(np.sum((y * w) ** 2))  # an exact fit's error is rounding
    bar = error / len(y) ** (2 / len(y))  # what a knee must beat

    def fits(knees: list[float]) -> list[tuple[float, float | None, np.ndarray]]:
        return [(error, knee, coef) for knee in knees
                for error, coef in [_fit_at(features, y, w, nonnegative, knee, onehot)]]

    rows = sorted({f.rows for f in features})[:-1]
    if len(rows) > MAX_KNEE_CANDIDATES:
        picks = np.linspace(0, len(rows) - 1, MAX_KNEE_CANDIDATES).round().astype(int)
        rows = [rows[i] for i in sorted(set(picks))]
    coarse = [float(r) for r in rows]
    tried = fits(coarse)
    # NOTE: two coarse knees can fit almost alike where the true one lies beside the second
    # (an exact synthetic clock: 40 rows 5.60e-5, 16 rows 5.61e-5, the clock's 10 between 4
    # and 40): refining only the first never reaches it.
    for seed in sorted(tried, key=lambda t: t[0])[:KNEE_SEEDS]:
        best, grid = seed, coarse
        for _ in range(KNEE_REFINE_LEVELS):
            if best[1] not in grid:
                break
            at = grid.index(best[1])
            low = grid[at - 1] if at > 0 else 0.0
            high = grid[at + 1] if at + 1 < len(grid) else best[1]
            grid = [float(k) for k in np.linspace(low, high, 2 * KNEE_REFINE + 1)]
            refined = fits(grid)
            tried += refined
            best = min([best, *refined], key=lambda t: t[0])
    knees = [t for t in tried if t[0] < bar - floor]
    return min(knees, key=lambda t: t[0]) if knees else line


def _least_squares(x: np.ndarray, y: np.ndarray, nonnegative: bool, bases: int = 1
                   ) -> np.ndarray:
    """argmin |x c - y|; with nonnegative, features (not the bases, the first `bases`
    columns) whose coefficient is negative are dropped one at a time, most negative
    first."""
    active = list(range(x.shape[1]))
    while True:
        coef = np.zeros(x.shape[1])
        coef[active], *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        negative = [i for i in active[bases:] if coef[i] < 0]
        if not nonnegative or not negative:
            return coef
        active.remove(min(negative, key=lambda i: coef[i]))


def profile_from_dict(data: dict) -> LinearCost:
    """A LinearCost from a profile dict; ValueError naming what is wrong."""
    if not isinstance(data, dict) or data.get("kind") != "linear":
        raise ValueError("profile: expected a JSON object with \"kind\": \"linear\"")
    if data.get("version") != PROFILE_VERSION:
        raise ValueError(f"profile: version {data.get('version')!r} is not "
                         f"{PROFILE_VERSION}")
    coefficients = data.get("coefficients")
    if not isinstance(coefficients, dict):
        raise ValueError("profile: coefficients must be an object")
    return LinearCost(data.get("base"), dict(coefficients), dict(data.get("meta") or {}),
                      data.get("knee"))


def load_profile(path: str | Path) -> LinearCost:
    """Read a profile written by `slotserve calibrate`."""
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc.msg})") from None
    try:
        return profile_from_dict(data)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
