"""Type checks for config and request values: a plain int, a finite real number (never a bool)."""

from __future__ import annotations

import math


def is_int(value: object) -> bool:
    """An int, not a bool (True passes isinstance(value, int))."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_finite_number(value: object) -> bool:
    """An int or float, not a bool, that a float holds finitely.

    False for NaN, inf and an int past 1e308 (math.isfinite raises OverflowError on it).
    """
    if not isinstance(value, int | float) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False
