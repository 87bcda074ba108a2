"""The host's work per decode step: what a step costs beyond its forward (issue 32, item 4).

    .venv/bin/python -m benchmarks.host_overhead                    # this tree
    .venv/bin/python -m benchmarks.host_overhead --baseline-src DIR # DIR/slotserve beside it

In process: a tiny random Llama (benchmarks/gpu_engine.py's "dry" shape with the embedded
SmolLM2's 49152-token vocabulary and tokenizer, so detokenizing is real) on the CPU, `batch`
sequences decoding (1/8/64/256); per step the wall time of `LLMEngine.step()` and, inside
the same step, of `runner.execute` (the forward, the runner's input building and sampling).
host = wall - forward: the scheduler, the token bookkeeping, detokenizing, the outputs.

Through the server: the same engine behind `build_app` (uvicorn, in a child process), one
streaming completion (the official openai client, in this process) of `--tokens` tokens:
the client's median gap between chunks beside the median `LLMEngine.step()` of the same
request (timed in the server; server_overhead_ms is the difference, ~0 while the event
loop keeps up: its work overlaps the next step), beside the batch-1 step in process of the
same round (client_gap_over_in_process: what the server costs a token, contention with
the forward on a small machine included), and the CPU time the server's event-loop thread
and engine thread spent per token (loop_cpu_ms_per_token: the SSE/HTTP work per token).

The garbage collector: in process, its pauses during the timed steps (total per step and
the longest; a collection of the oldest generation scans the whole start-up heap unless it
was frozen: --freeze-gc freezes it after the warm-up, as the server's AsyncEngine.launch
does since it has `freeze_heap`).

The tiny model's forward is small on purpose, so the host work shows. Each measurement runs
in its own child process; with --baseline-src the two trees alternate round by round (so a
machine shared with other work loads both alike): compare the medians, not one run's tok/s.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "benchmarks" / "results" / "host-overhead.json"


# --------------------------------------------------------------------------- the model
def tiny_engine(slots: int, max_model_len: int = 1024):
    """An LLMEngine of the "dry" shape with SmolLM2's tokenizer (eager, fp32, no prefix cache)."""
    import torch

    from benchmarks.gpu_engine import SHAPES, build_engine, model_config, random_weights
    from slotserve.loader import load_model

    torch.set_num_threads(1)
    tokenizer = load_model().tokenizer
    cfg = model_config(dict(SHAPES["dry"], vocab_size=tokenizer.vocab_size), max_model_len)
    weights = random_weights(cfg, torch.device("cpu"), torch.float32)
    engine = build_engine(cfg, weights, torch.device("cpu"), "float32", slots=max(slots, 2),
                          max_model_len=max_model_len, eager=True)
    engine.tokenizer = tokenizer
    return engine


def embedded_engine(slots: int):
    """The embedded SmolLM2-135M with the engine's defaults (as `slotserve serve` runs it)."""
    from slotserve.config import engine_config
    from slotserve.engine.llm_engine import LLMEngine

    return LLMEngine.from_config(engine_config(max_num_seqs=max(slots, 2)))


ENGINES = {"tiny": tiny_engine, "embedded": embedded_engine}


def prompts(count: int, length: int = 32) -> list[list[int]]:
    """Token ids of ordinary text pieces (ids 300..3299 of SmolLM2's vocabulary)."""
    return [[300 + (97 * i + 31 * j) % 3000 for j in range(length)] for i in range(count)]


# --------------------------------------------------------------------------- in process
def engine_steps(batch: int, steps: int, model: str = "tiny", freeze_gc: bool = False) -> dict:
    """Median wall, forward and host (wall - forward) milliseconds of a decode step; the
    longest step and the garbage collector's pauses. freeze_gc: freeze the heap after the
    warm-up as `AsyncEngine.launch` does (if this tree's does: the server's path)."""
    from slotserve.sampling import SamplingParams

    engine = ENGINES[model](batch)
    params = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(prompts(batch)):
        engine.add_request(f"r{i}", ids, params, prompt_text="")
    for seq in engine._sequences.values():  # NOTE: token-id prompts get a detokenizer too
        assert seq.detokenizer is not None
    while engine.scheduler.num_waiting or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running):
        engine.step()
    for _ in range(3):
        engine.step()
    if freeze_gc:
        from slotserve.engine import async_engine

        if hasattr(async_engine, "freeze_heap"):
            async_engine.freeze_heap()
    forward: list[float] = []
    execute = engine.runner.execute

    def timed(plan):
        start = time.perf_counter()
        try:
            return execute(plan)
        finally:
            forward.append(time.perf_counter() - start)

    engine.runner.execute = timed
    walls = []
    with GCPauses() as pauses:
        for _ in range(steps):
            start = time.perf_counter()
            outputs = engine.step()
            walls.append(time.perf_counter() - start)
            assert len(outputs) == batch
    host = [w - f for w, f in zip(walls, forward, strict=True)]
    return {"batch": batch, "steps": steps, "wall_ms": 1e3 * statistics.median(walls),
            "forward_ms": 1e3 * statistics.median(forward),
            "host_ms": 1e3 * statistics.median(host),
            "host_us_per_seq": 1e6 * statistics.median(host) / batch,
            "wall_max_ms": 1e3 * max(walls), "gc_ms_per_step": pauses.total_ms / steps,
            "gc_max_pause_ms": pauses.max_ms}


class GCPauses:
    """The garbage collector's pauses while the block runs (gc.callbacks): total, longest."""

    def __init__(self) -> None:
        self.total_ms = self.max_ms = 0.0
        self._start = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        pause = 1e3 * (time.perf_counter() - self._start)
        self.total_ms += pause
        self.max_ms = max(self.max_ms, pause)

    def __enter__(self) -> GCPauses:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)


# --------------------------------------------------------------------------- the server
def serve(port_file: str, model: str = "tiny") -> None:
    """Child: serve the tiny engine on a free port (written to port_file). Commands on
    stdin: "mark" starts counting; "report" prints (JSON) the engine's step times since the
    mark and the CPU time the event loop's and the engine's threads spent since, then exits."""
    import socket

    import uvicorn

    from slotserve.engine.async_engine import AsyncEngine
    from slotserve.server.api import build_app

    step_ms: list[float] = []

    def build():
        engine = ENGINES[model](2)  # NOTE: as engine_steps' batch 1 (slots max(batch, 2))
        step = engine.step

        def timed_step():
            start = time.perf_counter()
            outputs = step()
            if outputs:
                step_ms.append(1e3 * (time.perf_counter() - start))
            return outputs

        engine.step = timed_step
        return engine

    # NOTE: built in the engine thread, as `slotserve serve` does (AsyncEngine.launch)
    async_engine = AsyncEngine.launch(build)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    server = uvicorn.Server(uvicorn.Config(build_app(async_engine, "tiny"), host="127.0.0.1",
                                           port=port, log_level="warning"))
    loop_thread = threading.Thread(target=server.run, daemon=True)
    loop_thread.start()
    while not server.started:
        time.sleep(0.05)
    threads = {"loop": loop_thread, "engine": async_engine._thread}

    def cpu_ms() -> dict[str, float]:
        return {name: 1e3 * time.clock_gettime(time.pthread_getcpuclockid(t.ident))
                for name, t in threads.items()}

    Path(port_file).write_text(str(port))
    marked_cpu, marked_steps = cpu_ms(), 0
    for line in sys.stdin:
        if line.strip() == "mark":
            marked_cpu, marked_steps = cpu_ms(), len(step_ms)
            print("marked", flush=True)
        elif line.strip() == "report":
            now = cpu_ms()
            print(json.dumps({"step_ms": step_ms[marked_steps:],
                              "cpu_ms": {k: now[k] - marked_cpu[k] for k in now}}), flush=True)
            break
    server.should_exit = True
    async_engine.stop()


def client_gaps(port: int, tokens: int) -> list[float]:
    """One streaming completion through the openai client: ms between content chunks."""
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    times = []
    stream = client.completions.create(model="tiny", prompt=prompts(1)[0], max_tokens=tokens,
                                       temperature=0.0, stream=True,
                                       extra_body={"ignore_eos": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            times.append(time.perf_counter())
    return [1e3 * (b - a) for a, b in zip(times, times[1:])]


def server_tokens(src: Path, tokens: int, model: str = "tiny") -> dict:
    """One streamed completion: the client's gap per token against the engine's step (the
    same request, timed in the server), and the CPU the server's threads spent per token."""
    port_file = Path(f"/tmp/host_overhead_port_{os.getpid()}")
    port_file.unlink(missing_ok=True)
    child = subprocess.Popen([sys.executable, "-m", "benchmarks.host_overhead", "--serve",
                              str(port_file), "--model", model], cwd=REPO, env=_env(src), text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        while not port_file.exists():
            if child.poll() is not None:
                raise RuntimeError(f"the server exited with {child.returncode}")
            time.sleep(0.1)
        time.sleep(0.2)
        port = int(port_file.read_text())
        client_gaps(port, 16)  # warm: the first request builds what is lazy
        child.stdin.write("mark\n")
        child.stdin.flush()
        child.stdout.readline()
        gaps = client_gaps(port, tokens)
        out, _ = child.communicate("report\n", timeout=60)
    finally:
        port_file.unlink(missing_ok=True)
        if child.poll() is None:
            child.kill()
    report = json.loads(out.strip().splitlines()[-1])
    steps, cpu = report["step_ms"], report["cpu_ms"]
    count = len(gaps) + 1
    return {"tokens": tokens, "client_gap_ms": statistics.median(gaps),
            "client_gap_mean_ms": statistics.fmean(gaps), "client_gap_p90_ms": _p90(gaps),
            "engine_step_ms": statistics.median(steps),
            "server_overhead_ms": statistics.median(gaps) - statistics.median(steps),
            "loop_cpu_ms_per_token": cpu["loop"] / count,
            "engine_cpu_ms_per_token": cpu["engine"] / count}


def _p90(values: list[float]) -> float:
    return sorted(values)[int(0.9 * (len(values) - 1))]


# --------------------------------------------------------------------------- driver
def _env(src: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(src), str(REPO)])
    return env


def engine_round(src: Path, batches: list[int], steps: int, model: str,
                 freeze_gc: bool) -> list[dict]:
    """One child process measuring every batch with the slotserve of `src`."""
    out = subprocess.run([sys.executable, "-m", "benchmarks.host_overhead", "--engine-child",
                          "--batches", *map(str, batches), "--steps", str(steps),
                          "--model", model, *(["--freeze-gc"] if freeze_gc else [])],
                         cwd=REPO, env=_env(src), check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


ENGINE_FIGURES = ("wall_ms", "forward_ms", "host_ms", "host_us_per_seq", "wall_max_ms",
                  "gc_ms_per_step", "gc_max_pause_ms")
SERVER_FIGURES = ("client_gap_ms", "client_gap_mean_ms", "engine_step_ms", "server_overhead_ms",
                  "loop_cpu_ms_per_token", "engine_cpu_ms_per_token", "in_process_step_ms",
                  "client_gap_over_in_process")


def with_in_process(server: dict, engine_rows: list[dict]) -> dict:
    """The server's figures beside the same tree's batch-1 step in process (this round):
    what going through the server costs a token, contention on a small machine included."""
    batch1 = [r for r in engine_rows if r["batch"] == 1]
    if batch1:
        server["in_process_step_ms"] = batch1[0]["wall_ms"]
        server["client_gap_over_in_process"] = server["client_gap_ms"] / batch1[0]["wall_ms"]
    return server


def summarise(rounds: list[dict]) -> dict:
    """Per tree: the median over rounds of each figure."""
    engine: dict[int, list[dict]] = {}
    for r in rounds:
        for row in r["engine"]:
            engine.setdefault(row["batch"], []).append(row)
    summary = {"engine": [{"batch": b, **{k: statistics.median(x[k] for x in rows)
                                          for k in ENGINE_FIGURES if k in rows[0]}}
                          for b, rows in sorted(engine.items())]}
    servers = [r["server"] for r in rounds if r.get("server")]
    if servers:
        summary["server"] = {k: statistics.median(s[k] for s in servers)
                             for k in SERVER_FIGURES if all(k in s for s in servers)}
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--steps", type=int, default=60, help="timed decode steps per batch")
    parser.add_argument("--tokens", type=int, default=128, help="the streamed completion's")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline-src", type=Path, default=None,
                        help="a src/ directory of another slotserve to alternate with")
    parser.add_argument("--no-server", action="store_true")
    parser.add_argument("--model", choices=sorted(ENGINES), default="tiny",
                        help="tiny: a random 2-layer model (the host work shows); embedded: "
                             "SmolLM2-135M with the engine's defaults (batch 1 is the issue's)")
    parser.add_argument("--freeze-gc", action="store_true",
                        help="in process too, freeze the heap after the warm-up as the "
                             "server does (where the tree's AsyncEngine.launch does)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--engine-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        return serve(args.serve, args.model)
    if args.engine_child:
        print(json.dumps([engine_steps(b, args.steps, args.model, args.freeze_gc)
                          for b in args.batches]))
        return None
    trees = {"this": REPO / "src"}
    if args.baseline_src is not None:
        trees = {"baseline": args.baseline_src.resolve(), **trees}
    rounds: dict[str, list[dict]] = {name: [] for name in trees}
    for index in range(args.rounds):
        for name, src in trees.items():  # NOTE: interleaved: each round runs every tree
            row = {"engine": engine_round(src, args.batches, args.steps, args.model,
                                          args.freeze_gc)}
            if not args.no_server:
                row["server"] = with_in_process(server_tokens(src, args.tokens, args.model),
                                                row["engine"])
            rounds[name].append(row)
            print(f"round {index} {name}: " + ", ".join(
                f"b{r['batch']} host {r['host_ms']:.3f} ms (gc max {r['gc_max_pause_ms']:.1f})"
                for r in row["engine"])
                + (f"; server loop {row['server']['loop_cpu_ms_per_token']:.3f} ms CPU/token"
                   if "server" in row else ""), flush=True)
    result = {"settings": {k: v for k, v in vars(args).items()
                           if k in ("batches", "steps", "tokens", "rounds", "model", "freeze_gc")},
              "cpu": _cpu_name(), "load_avg": os.getloadavg(),
              "trees": {name: {"summary": summarise(r), "rounds": r}
                        for name, r in rounds.items()}}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({name: t["summary"] for name, t in result["trees"].items()}, indent=1))
    return None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    main()
