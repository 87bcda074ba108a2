"""The cost model's knee (issue 35): a step's cost against its rows bends upwards where the
decode stack turns from memory-bound (the weights read once, rows nearly free) to
compute-bound (every row its multiplies). `LinearCost(knee=...)`, `LinearCost.fit(knee=)`,
the profile file."""

from __future__ import annotations

import numpy as np
import pytest

from slotserve.lab.replay.cost_model import (
    FEATURES,
    KNEE_COEFFICIENT,
    LinearCost,
    StepFeatures,
    load_profile,
)

TRUTH = LinearCost(0.008, {"prefill_tokens": 1e-5, "decode_seqs": 5e-5, "attention_pairs": 1e-7,
                           "sampled_rows": 2e-5, KNEE_COEFFICIENT: 6e-4}, knee=11)
LINE = LinearCost(0.004, {"prefill_tokens": 2e-5, "decode_seqs": 3e-4, "attention_pairs": 1e-7,
                          "sampled_rows": 5e-5})


def _steps(count: int, seed: int = 0) -> list[StepFeatures]:
    """Decode steps of 1-64 rows, a quarter with a prefill chunk beside them."""
    rng = np.random.default_rng(seed)
    steps = []
    for _ in range(count):
        decodes = int(rng.integers(1, 65))
        prefill = int(rng.integers(1, 300)) if rng.random() < 0.25 else 0
        pairs = decodes * int(rng.integers(50, 300)) + prefill * prefill // 2
        steps.append(StepFeatures(prefill, decodes, pairs, decodes + (prefill > 0)))
    return steps


def test_rows_past_the_knee_cost_their_own_coefficient():
    below, at, past = (StepFeatures(0, n, 0, n) for n in (3, 11, 15))
    line = 0.008 + 7e-5 * 3
    assert TRUTH.step_seconds(below) == pytest.approx(line)
    assert TRUTH.step_seconds(at) == pytest.approx(0.008 + 7e-5 * 11)
    assert TRUTH.step_seconds(past) == pytest.approx(0.008 + 7e-5 * 15 + 6e-4 * 4)
    # a prefill chunk's tokens are rows too
    assert StepFeatures(10, 2, 0, 3).rows == 12


def test_the_fit_finds_the_knee_and_its_coefficients():
    steps = _steps(300)
    fit = LinearCost.fit([(f, TRUTH.step_seconds(f)) for f in steps], knee="auto")
    assert fit.knee == pytest.approx(11, abs=0.05)
    assert fit.base == pytest.approx(0.008, rel=1e-3)
    assert fit.coefficients[KNEE_COEFFICIENT] == pytest.approx(6e-4, rel=1e-3)
    assert fit.residuals([(f, TRUTH.step_seconds(f)) for f in steps])["max_rel_error"] < 1e-3
    # The line through both regimes misses the small steps by far.
    line = LinearCost.fit([(f, TRUTH.step_seconds(f)) for f in steps])
    assert line.knee is None
    assert line.residuals([(f, TRUTH.step_seconds(f)) for f in steps])["max_rel_error"] > 0.2


def test_a_line_stays_a_line_even_with_noise():
    steps = _steps(300, seed=1)
    exact = LinearCost.fit([(f, LINE.step_seconds(f)) for f in steps], knee="auto")
    assert exact.knee is None and KNEE_COEFFICIENT not in exact.coefficients
    rng = np.random.default_rng(2)
    noisy = [(f, LINE.step_seconds(f) * (1 + 0.03 * rng.standard_normal())) for f in steps]
    fit = LinearCost.fit(noisy, knee="auto")
    assert fit.knee is None
    assert fit.coefficients["decode_seqs"] + fit.coefficients["sampled_rows"] == \
        pytest.approx(3.5e-4, rel=0.1)


def test_a_fixed_knee_is_fit_at_that_knee():
    steps = _steps(120, seed=3)
    fit = LinearCost.fit([(f, TRUTH.step_seconds(f)) for f in steps], knee=11)
    assert fit.knee == 11.0
    assert fit.coefficients[KNEE_COEFFICIENT] == pytest.approx(6e-4, rel=1e-6)


def test_profile_round_trip_keeps_the_knee(tmp_path):
    path = tmp_path / "profile.json"
    TRUTH.save(path)
    again = load_profile(path)
    assert (again.base, again.coefficients, again.knee) == (TRUTH.base, TRUTH.coefficients,
                                                            TRUTH.knee)
    assert TRUTH.describe()["knee"] == 11 and "knee" not in LINE.describe()
    assert "rows_past_knee" in TRUTH.format() and "past 11 rows" in TRUTH.format()
    LINE.save(path)
    assert load_profile(path).knee is None


@pytest.mark.parametrize("knee, coefficients, message", [
    (None, {KNEE_COEFFICIENT: 1e-4}, "needs a knee"),
    (8, {}, "missing 'rows_past_knee'"),
    (-1, {KNEE_COEFFICIENT: 1e-4}, "knee must be"),
    (float("nan"), {KNEE_COEFFICIENT: 1e-4}, "knee must be"),
    (True, {KNEE_COEFFICIENT: 1e-4}, "knee must be"),
    ("8", {KNEE_COEFFICIENT: 1e-4}, "knee must be"),
])
def test_bad_knees_are_refused(knee, coefficients, message):
    with pytest.raises(ValueError, match=message):
        LinearCost(0.01, {**dict.fromkeys(FEATURES, 1e-4), **coefficients}, knee=knee)


def test_a_bad_knee_argument_to_fit_is_refused():
    samples = [(f, LINE.step_seconds(f)) for f in _steps(20)]
    with pytest.raises(ValueError, match="knee must be None, a number of rows or 'auto'"):
        LinearCost.fit(samples, knee="best")
