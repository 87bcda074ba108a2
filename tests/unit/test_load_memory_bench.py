"""benchmarks/load_memory.py: one load in a fresh process reports its figures."""

from __future__ import annotations

from pathlib import Path

from benchmarks.load_memory import load_once
from slotserve.loader import default_model_path

REPO = Path(__file__).resolve().parents[2]


def test_one_load_reports_its_seconds_and_memory():
    figures = load_once(str(REPO), default_model_path(), "bf16")
    assert set(figures) == {"seconds", "rss_mib", "hwm_mib", "huge_mib"}
    assert 0 < figures["seconds"] < 300
    assert 100 < figures["rss_mib"] <= figures["hwm_mib"]  # the embedded model is ~100 MB
    assert figures["huge_mib"] >= 0
