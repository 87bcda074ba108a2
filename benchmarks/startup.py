"""A model file's start-up: launch to a healthy /health, two trees and llama.cpp interleaved.

    .venv/bin/python -m benchmarks.startup --files A.gguf,B.gguf --rounds 3 \
        --trees before=/path/to/old/checkout after=. \
        --llama-server /tmp/llama-build/bin/llama-server

Each (file, server) starts `--rounds` times, the servers' order rotated each round:
`slotserve serve` with benchmarks/quant.py's flags (`slotserve_flags`: the file's own
blocks, or `--quantization`; 64 sequences of 512 tokens), each tree's `src` on
PYTHONPATH, and llama.cpp's server as quant.py starts it (benchmarks/perf.py's
`llama_server`: 64 slots of 512, 2 threads, no warm-up). Before each start the file is
read once (the page cache warm: a VM's reclaim evicts it between runs otherwise). Per
start: seconds from launch to /health answering 200 (polled every 50 ms) and the server's
VmHWM then; per (file, server): the runs and their medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.perf import llama_server
from benchmarks.quant import CTX_PER_SLOT, LLAMA_THREADS, SLOTS, slotserve_flags
from slotserve.lab.bench.server import ServerProcess, wait_healthy

POLL_S = 0.05
TIMEOUT_S = 300.0


def peak_rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM")) / 1024


def warm_page_cache(model: str) -> None:
    """Read a model's file (or every file of its directory) once."""
    paths = [Path(model)] if Path(model).is_file() else sorted(Path(model).iterdir())
    for path in paths:
        if path.is_file():
            with open(path, "rb") as f:
                while f.read(1 << 24):
                    pass


def parse_trees(items: list[str]) -> dict[str, str]:
    """`--trees NAME=DIR ...` -> name: the checkout's resolved directory."""
    return {name: str(Path(tree).resolve())
            for name, _, tree in (item.partition("=") for item in items)}


def start_slotserve(tree: str, path: str, quantization: str) -> tuple[float, float]:
    """(seconds to healthy, VmHWM MiB) of one start of `tree`'s slotserve."""
    with tempfile.TemporaryDirectory() as logs:
        start = time.perf_counter()
        server = ServerProcess.launch(Path(logs) / "serve.log",
                                      *slotserve_flags(Path(path), quantization),
                                      env={"PYTHONPATH": f"{tree}/src{os.pathsep}{tree}"})
        try:
            wait_healthy(server.url, TIMEOUT_S, lambda: server.proc.poll() is not None,
                         lambda: server.log()[-3000:], poll_s=POLL_S)
            return time.perf_counter() - start, peak_rss_mib(server.proc.pid)
        finally:
            server.stop()


def start_llamacpp(binary: str, path: str) -> tuple[float, float]:
    """(seconds to healthy, VmHWM MiB) of one start of llama.cpp's server."""
    server = llama_server(binary, path, SLOTS, LLAMA_THREADS, ctx_per_slot=CTX_PER_SLOT,
                          poll_s=POLL_S)
    start = time.perf_counter()
    with server:
        return time.perf_counter() - start, peak_rss_mib(server.proc.pid)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--files", required=True, help="GGUF files, comma-separated")
    p.add_argument("--trees", nargs="+", default=["this=."],
                   help="NAME=DIR: checkouts of slotserve to start")
    p.add_argument("--llama-server", default=None, help="llama.cpp's server, started too")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quantization", default="gguf",
                   help="slotserve's --quantization (gguf: the file's own blocks; auto: the "
                        "CPU class's default, bf16 panels on x86; none: fp32 panels)")
    args = p.parse_args()
    servers: dict[str, str | None] = dict(parse_trees(args.trees))
    if args.llama_server:
        servers["llama.cpp"] = None
    runs: dict[tuple[str, str], list[tuple[float, float]]] = {}
    names = list(servers)
    for r in range(args.rounds):
        for path in args.files.split(","):
            for name in names[r % len(names):] + names[:r % len(names)]:
                warm_page_cache(path)
                tree = servers[name]
                seconds, mib = (start_llamacpp(args.llama_server, path) if tree is None
                                else start_slotserve(tree, path, args.quantization))
                runs.setdefault((Path(path).name, name), []).append((seconds, mib))
                print(f"round {r} {Path(path).name} {name}: {seconds:.2f} s, VmHWM {mib:.0f} MiB",
                      flush=True)
    print("\nfile | server | start-up s (runs) | median | VmHWM MiB (median)")
    for (file, name), values in runs.items():
        times = [t for t, _ in values]
        print(f"{file} | {name} | {', '.join(f'{t:.2f}' for t in times)} | "
              f"{statistics.median(times):.2f} | {statistics.median(m for _, m in values):.0f}")


if __name__ == "__main__":
    main()
