"""Where slotserve keeps files between runs (no torch: the lab's commands use it too)."""

from __future__ import annotations

import os
from pathlib import Path

CALIBRATION_FILE = "calibration.json"


def cache_root() -> str:
    """`$SLOTSERVE_CACHE_DIR`, else `$XDG_CACHE_HOME/slotserve`, else `~/.cache/slotserve`."""
    if root := os.environ.get("SLOTSERVE_CACHE_DIR"):
        return root
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(xdg, "slotserve")


def last_calibration_path() -> Path:
    """The profile `slotserve calibrate` wrote last on this machine; `slotserve replay`'s
    default clock. `$SLOTSERVE_CALIBRATION` names another file (the tests' own)."""
    if path := os.environ.get("SLOTSERVE_CALIBRATION"):
        return Path(path)
    return Path(cache_root()) / CALIBRATION_FILE
