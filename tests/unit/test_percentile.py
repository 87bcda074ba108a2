"""The one percentile definition: numpy's linear interpolation, everywhere."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from slotserve.lab.bench.stats import LatencyStats
from slotserve.percentile import percentile

finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False)


@given(st.lists(finite, min_size=1, max_size=60), st.floats(min_value=0, max_value=100))
def test_percentile_is_numpys_linear_interpolation(values, q):
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), abs=1e-6)


def test_percentile_edges():
    assert percentile([], 50) is None
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError, match="q must be"):
        percentile([1.0], 101)


def test_bench_stats_and_the_live_view_agree():
    from slotserve.obs import live_feed

    seconds = [0.010, 0.020, 0.035, 0.5]
    assert LatencyStats.of(seconds).p99 == pytest.approx(percentile(seconds, 99) * 1000)
    assert live_feed.percentile is percentile
