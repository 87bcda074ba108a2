"""Cost models: how long one iteration takes, as a function of what the scheduler planned.

An iteration's plan (a `SchedulerOutput`) is reduced to `StepFeatures`:

- prefill_tokens: tokens of prefill chunks (rows through every linear layer);
- decode_seqs: sequences decoding one token (rows too, but also one KV read each);
- attention_pairs: query-key pairs the attention computes: a chunk of n tokens starting at
  position s attends to s+1 .. s+n positions, n*s + n(n+1)/2 pairs (a decode: its context);
- sampled_rows: rows that go through the LM head and the sampler.

A decode verified with k draft tokens (speculative decoding) has 1 + k rows with logits at
each: 1 + k sampled rows and its attention pairs. In an iteration of decodes only, the
runner computes every row as a decode row of the C++ decode stack (each reads its
sequence's KV up to its own position: `attention.metadata._one_decode_group`), so the k
drafts count as k more decode rows (`decode_seqs`); beside a prefill chunk the iteration
takes the general path, where the verification is a chunk of 1 + k tokens: one decode
sequence and k prefill tokens.

`LinearCost` charges seconds = base + sum(coefficient x feature), fit per machine, model
and kernel set by least squares (`LinearCost.fit`, numpy); `slotserve calibrate` measures
the samples and writes the profile file (`save` / `load_profile`). `UnitCost` is the seed's
toy clock: every iteration takes one unit, whatever it does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from slotserve.config import SlotKind
from slotserve.core.outputs import SchedulerOutput

PROFILE_VERSION = 1
FEATURES = ("prefill_tokens", "decode_seqs", "attention_pairs", "sampled_rows")


@dataclass(frozen=True)
class StepFeatures:
    """What one iteration computes (see the module docstring)."""

    prefill_tokens: int = 0
    decode_seqs: int = 0
    attention_pairs: int = 0
    sampled_rows: int = 0

    @classmethod
    def of(cls, plan: SchedulerOutput) -> StepFeatures:
        prefill = decode = pairs = sampled = 0
        decode_only = all(seq.kind == SlotKind.DECODE for seq in plan.seqs)
        for seq in plan.seqs:
            n, start = seq.num_tokens, seq.start_pos
            drafts = len(seq.spec_token_ids)
            if seq.kind == SlotKind.DECODE:
                # NOTE: a verification's rows after its first: decode rows on the decode
                # stack (an iteration of decodes only), else rows of a chunk.
                decode += 1 + (drafts if decode_only else 0)
                prefill += 0 if decode_only else drafts
            else:
                prefill += n
            pairs += n * start + n * (n + 1) // 2
            sampled += seq.sample + drafts
        return cls(prefill, decode, pairs, sampled)

    def vector(self) -> list[float]:
        """[1, features...]: the row of the least-squares design matrix."""
        return [1.0, *(float(getattr(self, name)) for name in FEATURES)]


class UnitCost:
    """The seed's toy clock: one unit of time per iteration."""

    name = "unit"

    def step_seconds(self, features: StepFeatures) -> float:
        return 1.0

    def describe(self) -> dict:
        return {"kind": "unit"}


@dataclass
class LinearCost:
    """seconds = base + sum(coefficients[f] * feature f); `meta` says where it was fit."""

    base: float
    coefficients: dict[str, float]
    meta: dict = field(default_factory=dict)
    name = "linear"

    def __post_init__(self) -> None:
        missing = set(FEATURES) - set(self.coefficients)
        if missing:
            raise ValueError(f"coefficients is missing {sorted(missing)}")
        for key, value in [("base", self.base), *self.coefficients.items()]:
            if not isinstance(value, (int, float)) or not np.isfinite(value):
                raise ValueError(f"coefficient {key} must be a finite number, got {value!r}")

    def step_seconds(self, features: StepFeatures) -> float:
        seconds = self.base + sum(self.coefficients[f] * getattr(features, f) for f in FEATURES)
        # NOTE: a fit may give a small negative coefficient; time never runs backwards.
        return max(seconds, 0.0)

    @classmethod
    def fit(cls, samples: list[tuple[StepFeatures, float]], relative: bool = True,
            nonnegative: bool = True, meta: dict | None = None) -> LinearCost:
        """Least squares over (features, measured seconds) samples.

        relative: weight each sample by 1/seconds, so a 10 ms step's error counts as much
        as a 1 s step's in proportion (minimises relative, not absolute, error).
        nonnegative: no feature may make an iteration cheaper. Features are collinear in
        practice (every decode sequence is also a sampled row), and noise then gives one a
        large negative coefficient and its twin a large positive one; a feature whose
        coefficient comes out negative is dropped (held at 0) and the rest refit, until
        none is negative.
        """
        if len(samples) < len(FEATURES) + 1:
            raise ValueError(f"samples: need at least {len(FEATURES) + 1} to fit "
                             f"{len(FEATURES) + 1} coefficients, got {len(samples)}")
        x = np.array([f.vector() for f, _ in samples])
        y = np.array([s for _, s in samples], dtype=float)
        if not np.all(y > 0):
            raise ValueError("samples: measured seconds must be > 0")
        w = 1.0 / y if relative else np.ones_like(y)
        coef = _least_squares(x * w[:, None], y * w, nonnegative)
        return cls(float(coef[0]), {f: float(c) for f, c in zip(FEATURES, coef[1:])},
                   dict(meta or {}))

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
                **({"model": self.meta["model"]} if "model" in self.meta else {})}

    def to_profile(self) -> dict:
        return {"version": PROFILE_VERSION, "kind": "linear", "base": self.base,
                "coefficients": dict(self.coefficients), "meta": self.meta}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_profile(), indent=1) + "\n")

    def format(self) -> str:
        """The fit in one line per coefficient, in readable units."""
        lines = [f"  base            {self.base * 1000:10.3f} ms per iteration"]
        units = {"prefill_tokens": "ms per prefill token", "decode_seqs": "ms per decode seq",
                 "attention_pairs": "ms per 1k query-key pairs",
                 "sampled_rows": "ms per sampled row"}
        for f in FEATURES:
            scale = 1e6 if f == "attention_pairs" else 1000
            lines.append(f"  {f:<16}{self.coefficients[f] * scale:10.4f} {units[f]}")
        return "\n".join(lines)


def _least_squares(x: np.ndarray, y: np.ndarray, nonnegative: bool) -> np.ndarray:
    """argmin |x c - y|; with nonnegative, features (not the base, column 0) whose
    coefficient is negative are dropped one at a time, most negative first."""
    active = list(range(x.shape[1]))
    while True:
        coef = np.zeros(x.shape[1])
        coef[active], *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        negative = [i for i in active[1:] if coef[i] < 0]
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
    return LinearCost(data.get("base"), dict(coefficients), dict(data.get("meta") or {}))


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
