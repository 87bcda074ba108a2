"""A GGUF file's start-up: launch to a healthy /health, two trees and llama.cpp interleaved.

    .venv/bin/python -m benchmarks.startup --files A.gguf,B.gguf --rounds 3 \
        --trees before=/path/to/old/checkout after=. \
        --llama-server /tmp/llama-build/bin/llama-server

Each (file, server) starts `--rounds` times, the servers' order rotated each round:
`slotserve serve --model FILE --quantization gguf` with benchmarks/quant.py's flags (64
sequences of 512 tokens, 2048 KV blocks), each tree's `src` on PYTHONPATH, and llama.cpp's
server with quant.py's slots (64 x 512, 2 threads, no warm-up). Before each start the file
is read once (the page cache warm: a VM's reclaim evicts it between runs otherwise). Per
start: seconds from launch to /health answering 200 (polled every 50 ms) and the server's
VmHWM then; per (file, server): the runs and their medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from slotserve.lab.bench.server import HOST, free_port, wait_healthy

SLOTS, CONTEXT, BLOCKS = 64, 512, 2048
POLL_S = 0.05
TIMEOUT_S = 300.0


def server_command(tree: str | None, llama_server: str, path: str, port: int) -> list[str]:
    """slotserve from `tree`, or llama.cpp's server where tree is None."""
    if tree is None:
        return [llama_server, "-m", path, "--host", HOST, "--port", str(port), "--parallel",
                str(SLOTS), "--threads", "2", "-c", str(SLOTS * CONTEXT), "--no-warmup"]
    return [sys.executable, "-m", "slotserve.cli", "serve", "--model", path, "--quantization",
            "gguf", "--max-num-seqs", str(SLOTS), "--max-model-len", str(CONTEXT),
            "--num-blocks", str(BLOCKS), "--host", HOST, "--port", str(port)]


def peak_rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM")) / 1024


def start_once(tree: str | None, llama_server: str, path: str) -> tuple[float, float]:
    """(seconds to healthy, VmHWM MiB) of one start."""
    with open(path, "rb") as f:  # the page cache warm
        while f.read(1 << 24):
            pass
    port = free_port()
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = f"{tree}/src{os.pathsep}{tree}"
    with tempfile.TemporaryFile("w+") as log:
        start = time.perf_counter()
        proc = subprocess.Popen(server_command(tree, llama_server, path, port), env=env,
                                stdout=log, stderr=subprocess.STDOUT, text=True)

        def tail() -> str:
            log.seek(0)
            return log.read()[-2000:]
        try:
            wait_healthy(f"http://{HOST}:{port}", TIMEOUT_S, lambda: proc.poll() is not None,
                         tail, poll_s=POLL_S)
            return time.perf_counter() - start, peak_rss_mib(proc.pid)
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--files", required=True, help="GGUF files, comma-separated")
    p.add_argument("--trees", nargs="+", default=["this=."],
                   help="NAME=DIR: checkouts of slotserve to start")
    p.add_argument("--llama-server", default=None, help="llama.cpp's server, started too")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    servers: dict[str, str | None] = {}
    for item in args.trees:
        name, _, tree = item.partition("=")
        servers[name] = str(Path(tree).resolve())
    if args.llama_server:
        servers["llama.cpp"] = None
    runs: dict[tuple[str, str], list[tuple[float, float]]] = {}
    names = list(servers)
    for r in range(args.rounds):
        for path in args.files.split(","):
            for name in names[r % len(names):] + names[:r % len(names)]:
                seconds, mib = start_once(servers[name], args.llama_server, path)
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
