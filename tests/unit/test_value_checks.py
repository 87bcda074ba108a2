"""value_checks: is_int (an int, not a bool) and is_finite_number (a finite real, not a bool)."""

from __future__ import annotations

import pytest

from slotserve.value_checks import is_finite_number, is_int

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(("value", "expected"), [
    (0, True), (-3, True), (2**70, True),
    (True, False), (False, False), (1.5, False), (2.0, False), ("1", False), (None, False),
])
def test_is_int(value, expected):
    assert is_int(value) is expected


@pytest.mark.parametrize(("value", "expected"), [
    (0, True), (-2, True), (1.5, True), (1e308, True), (-1e308, True), (2**70, True),
    (True, False), (False, False), (NAN, False), (INF, False), (-INF, False),
    (10**400, False), (-(10**400), False), ("1", False), (None, False),
])
def test_is_finite_number(value, expected):
    assert is_finite_number(value) is expected
