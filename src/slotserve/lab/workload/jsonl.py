"""JSONL workload files: `load_workload` and `save_workload` (the format: see the package)."""

from __future__ import annotations

import json
from pathlib import Path

from slotserve.lab.workload.requests import POLICY_DEFAULTS, BenchRequest, Workload


def load_workload(path: str | Path) -> Workload:
    """Read a JSONL workload (see the package docstring); ValueError names the bad line."""
    requests = []
    with open(path) as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                requests.append(_parse_line(line, number, path))
    if not requests:
        raise ValueError(f"{path}: no requests")
    offline = all(r.arrival == 0 for r in requests)
    return Workload(tuple(requests), {"source": str(path), "num_requests": len(requests),
                                      "request_rate": "inf" if offline else "file"})


def _parse_line(line: str, number: int, path: str | Path) -> BenchRequest:
    try:
        item = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}:{number}: not JSON ({exc.msg})") from None
    if not isinstance(item, dict) or "max_tokens" not in item:
        raise ValueError(f"{path}:{number}: expected an object with 'max_tokens'")
    try:
        return BenchRequest(id=str(number - 1), max_tokens=item["max_tokens"],
                            prompt=item.get("prompt"), messages=item.get("messages"),
                            arrival=float(item.get("arrival", 0.0)), n=item.get("n", 1),
                            turns=tuple(item.get("turns") or ()),
                            **{k: item[k] for k in POLICY_DEFAULTS if k in item})
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{path}:{number}: {exc}") from None


def save_workload(workload: Workload, path: str | Path) -> None:
    """Write the workload as JSONL (load_workload reads it back)."""
    lines = (json.dumps(r.to_dict()) for r in workload.requests)
    Path(path).write_text("".join(line + "\n" for line in lines))
