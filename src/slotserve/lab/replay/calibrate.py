"""Calibration: time real engine iterations over a small grid and fit a `LinearCost`.

For each chunk size (the token budget, `max_num_batched_tokens`), batch size B and context
length L of the grid, a fresh engine runs a warm-up (2 prompts of 8 tokens: its first step
is the engine's first forward, `StepFeatures.first_forward`), then prefills B requests with
L-token random prompts (in chunks) and decodes `decode_steps` tokens; every `engine.step()`
is timed whole (the forward, the sampler, the scheduler and the engine's bookkeeping: what a
served iteration costs) and paired with its plan's `StepFeatures`. Prefix caching is off, so
every prompt token is computed.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import asdict, dataclass

import numpy as np

from slotserve.lab.replay.cost_model import LinearCost, StepFeatures
from slotserve.sampling import SamplingParams

WARM_UP = (2, 8)  # each engine's first requests: batch, context (kept as samples)


@dataclass(frozen=True)
class CalibrationGrid:
    """The points measured (a few minutes for SmolLM2-135M on 2 quiet cores).

    NOTE: the fit extrapolates poorly: cover the batch sizes and contexts the served
    workload reaches (benchmarks/RESULTS.md, section 4: 64 slots fit on batches <= 32 and
    contexts <= 128 came out ~1.8x fast).
    """

    batch_sizes: tuple[int, ...] = (1, 4, 16, 64)
    context_lens: tuple[int, ...] = (32, 384)
    chunk_sizes: tuple[int, ...] = (128, 512)
    decode_steps: int = 6

    def __post_init__(self) -> None:
        for name in ("batch_sizes", "context_lens", "chunk_sizes"):
            values = getattr(self, name)
            if not values or any(not isinstance(v, int) or v < 1 for v in values):
                raise ValueError(f"{name} must be integers >= 1, got {values!r}")
        if not isinstance(self.decode_steps, int) or self.decode_steps < 1:
            raise ValueError(f"decode_steps must be an integer >= 1, got {self.decode_steps!r}")


@dataclass
class Sample:
    """One timed iteration: the grid point it belongs to, its features and its seconds."""

    batch: int
    context: int
    chunk: int
    features: StepFeatures
    seconds: float


def measure(target, grid: CalibrationGrid, *, seed: int = 0, log=None) -> list[Sample]:
    """Time every iteration of every grid point on `target` (a bench `EngineTarget`)."""
    rng = np.random.default_rng(seed)
    vocab = target.model_config.vocab_size
    samples: list[Sample] = []
    max_context = max(grid.context_lens) + grid.decode_steps + 1
    for chunk in grid.chunk_sizes:
        configured = target.configured(max_num_seqs=max(grid.batch_sizes),
                                       max_num_batched_tokens=chunk,
                                       enable_prefix_caching=False,
                                       max_model_len=max(max_context, 64))
        for batch in grid.batch_sizes:
            for context in grid.context_lens:
                # NOTE: a fresh engine per point: each engine's steps run at a level of its
                # own (SmolLM2 on a 2-core Xeon: the same 64-row decode 31 ms in one, 37 in
                # the next, steady within each; not its KV pool's huge pages, cause not
                # pinned), so a fit on one engine per chunk size took two such draws for
                # every decode of 64 rows.
                engine = configured.build()
                plans = _capture_plans(engine)
                # NOTE: a warm-up, kept: its first step is the engine's first forward
                warm = _run_point(engine, plans, WARM_UP[0], WARM_UP[1], 2, rng, vocab,
                                  fresh=True)
                timed = _run_point(engine, plans, batch, context, grid.decode_steps, rng, vocab)
                del engine
                samples += [Sample(*WARM_UP, chunk, f, s) for f, s in warm]
                samples += [Sample(batch, context, chunk, f, s) for f, s in timed]
                if log is not None:
                    total = sum(s for _, s in timed)
                    log(f"  chunk {chunk:>5}  batch {batch:>3}  context {context:>5}: "
                        f"{len(timed)} iterations, {total:.2f} s")
    return samples


def _capture_plans(engine) -> list:
    """Record each plan the engine's scheduler makes (read by `_run_point`)."""
    plans: list = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        plan = schedule()
        plans.append(plan)
        return plan

    # NOTE: an instance attribute on this calibration engine only; the scheduler is unchanged.
    engine.scheduler.schedule = recording_schedule
    return plans


def _run_point(engine, plans: list, batch: int, context: int, decode_steps: int,
               rng: np.random.Generator, vocab: int, fresh: bool = False
               ) -> list[tuple[StepFeatures, float]]:
    """Each timed step of `batch` prompts of `context` random tokens decoding `decode_steps`
    tokens; fresh: the engine has not run before (its first step is its first forward)."""
    params = SamplingParams(max_tokens=decode_steps + 1, ignore_eos=True, temperature=0.0)
    for i in range(batch):
        prompt = rng.integers(3, vocab, size=context).tolist()
        engine.add_request(f"cal-{time.monotonic_ns()}-{i}", prompt, params)
    timed = []
    while engine.has_unfinished_requests():
        plans.clear()
        start = time.perf_counter()
        engine.step()
        seconds = time.perf_counter() - start
        if plans and not plans[-1].is_empty:
            timed.append((StepFeatures.of(plans[-1], first_forward=fresh and not timed),
                          seconds))
    return timed


def calibrate(target, grid: CalibrationGrid, *, seed: int = 0, log=None
              ) -> tuple[LinearCost, list[Sample]]:
    """Measure the grid and fit; the model's `meta` records what, where and how well."""
    from slotserve.lab.bench.stats import machine_info

    started = time.perf_counter()
    samples = measure(target, grid, seed=seed, log=log)
    pairs = [(s.features, s.seconds) for s in samples]
    model = LinearCost.fit(pairs)
    kwargs = target.engine_kwargs
    model.meta = {
        "model": target.source, "device": kwargs.get("device", "cpu"),
        "dtype": kwargs.get("dtype"), "kernels": kwargs.get("kernels", "auto"),
        "quantization": kwargs.get("quantization"), "grid": asdict(grid),
        "seconds": round(time.perf_counter() - started, 1), "fit": model.residuals(pairs),
        "machine": machine_info(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "samples": [{"batch": s.batch, "context": s.context, "chunk": s.chunk,
                     **asdict(s.features), "seconds": round(s.seconds, 6)} for s in samples]}
    return model, samples


def format_points(model: LinearCost, samples: list[Sample]) -> str:
    """Measured vs predicted per grid point (sum over its iterations)."""
    groups: dict[tuple[int, int, int], list[Sample]] = {}
    for s in samples:
        groups.setdefault((s.chunk, s.batch, s.context), []).append(s)
    lines = [f"  {'chunk':>5} {'batch':>5} {'context':>7} {'iters':>5} {'measured s':>10} "
             f"{'predicted s':>11} {'ratio':>6}"]
    for (chunk, batch, context), group in groups.items():
        measured = sum(s.seconds for s in group)
        predicted = sum(model.step_seconds(s.features) for s in group)
        lines.append(f"  {chunk:>5} {batch:>5} {context:>7} {len(group):>5} {measured:>10.3f} "
                     f"{predicted:>11.3f} {predicted / measured:>6.2f}")
    return "\n".join(lines)


def format_residuals(fit: dict) -> str:
    return (f"  {fit['samples']} iterations: RMS {fit['rms_ms']:.2f} ms, relative error "
            f"median {fit['median_rel_error']:.1%}, p90 {fit['p90_rel_error']:.1%}, "
            f"max {fit['max_rel_error']:.1%}; total time off by {fit['total_rel_error']:.1%}")
