"""Calibration: time real engine iterations over a small grid and fit a `LinearCost`.

For each chunk size (the token budget, `max_num_batched_tokens`), batch size B and context
length L of the grid, a fresh engine runs a warm-up (2 prompts of 8 tokens: its first step
is the engine's first forward, `StepFeatures.first_forward`), then prefills B requests with
L-token random prompts (in chunks) and decodes `decode_steps` tokens, then makes iterations
of a prefill chunk beside decodes (`_run_mixed`: B short prompts decode while one L-token
prompt is prefilled beside them, `StepFeatures.mixed_decodes`); every `engine.step()`
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
MIXED_PROMPT = 8  # tokens of each prompt that decodes beside a prefill in `_run_mixed`


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
    """One timed iteration: the grid point it belongs to, its features and its seconds;
    phase: "warm-up" (the engine's first requests, WARM_UP), "point" (the grid point's
    prompts) or "mixed" (`_run_mixed`)."""

    batch: int
    context: int
    chunk: int
    features: StepFeatures
    seconds: float
    phase: str = "point"


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
                # NOTE: a fresh engine per point: each engine's steps ran at a level of its
                # own (SmolLM2 on a 2-core Xeon: the same 64-row decode 31 ms in one, 37 in
                # the next, steady within each; one cause found since, the heap giving a
                # step's logits back, runner/heap.py), so a fit on one engine per chunk size
                # took two such draws for every decode of 64 rows.
                engine = configured.build()
                plans = _capture_plans(engine)
                # NOTE: a warm-up, kept: its first step is the engine's first forward
                warm = _run_point(engine, plans, WARM_UP[0], WARM_UP[1], 2, rng, vocab,
                                  fresh=True)
                timed = _run_point(engine, plans, batch, context, grid.decode_steps, rng, vocab)
                mixed = _run_mixed(engine, plans, batch, context, rng, vocab)
                del engine
                samples += [Sample(*WARM_UP, chunk, f, s, "warm-up") for f, s in warm]
                samples += [Sample(batch, context, chunk, f, s) for f, s in timed]
                samples += [Sample(batch, context, chunk, f, s, "mixed") for f, s in mixed]
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
    _add_prompts(engine, batch, context, decode_steps + 1, rng, vocab)
    return _timed_steps(engine, plans, engine.has_unfinished_requests, fresh)


def _run_mixed(engine, plans: list, batch: int, context: int, rng: np.random.Generator,
               vocab: int) -> list[tuple[StepFeatures, float]]:
    """Each timed step of `batch` prompts of MIXED_PROMPT tokens (fewer if the engine has
    not the slots) that start decoding, then go on decoding while a prompt of `context`
    tokens is prefilled beside them (in chunks), until its first token.

    NOTE: the grid's points make few iterations of a prefill chunk beside decodes (a
    point's prompts start together), and they are what a served workload with arrivals
    spread in time makes most (W at 16 slots: a new prompt beside 15 decodes).
    """
    decoders = min(batch, engine.scheduler_config.max_num_seqs - 1)
    if decoders < 1:
        return []
    short_ids = _add_prompts(engine, decoders, MIXED_PROMPT, engine.max_total_tokens, rng,
                             vocab)
    plans.clear()  # NOTE: else the last phase's last plan (decodes only) ends the loop at once
    timed = _timed_steps(engine, plans, lambda: not _decodes_only(plans))
    [long_id] = _add_prompts(engine, 1, context, 1, rng, vocab)
    timed += _timed_steps(engine, plans, lambda: engine.has_request(long_id))
    for request_id in short_ids:
        engine.abort_request(request_id)
    return timed


def _add_prompts(engine, count: int, context: int, max_tokens: int,
                 rng: np.random.Generator, vocab: int) -> list[str]:
    """Add `count` greedy requests of `context` random tokens; their ids."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    ids = [f"cal-{time.monotonic_ns()}-{i}" for i in range(count)]
    for request_id in ids:
        engine.add_request(request_id, rng.integers(3, vocab, size=context).tolist(), params)
    return ids


def _decodes_only(plans: list) -> bool:
    """The last step's plan holds decodes only (every sequence is past its prefill)."""
    return bool(plans) and all(seq.is_one_token_decode for seq in plans[-1].seqs)


def _timed_steps(engine, plans: list, running, fresh: bool = False
                 ) -> list[tuple[StepFeatures, float]]:
    """Step the engine while running() is true; each step's (features, seconds).
    fresh: the engine has not run before (its first step is its first forward)."""
    timed = []
    while running():
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
    from slotserve.lab.bench.report import model_name
    from slotserve.lab.bench.stats import machine_info

    started = time.perf_counter()
    samples = measure(target, grid, seed=seed, log=log)
    pairs = [(s.features, s.seconds) for s in samples]
    model = fit_grid(pairs)
    kwargs = target.engine_kwargs
    model.meta = {
        "model": model_name(target.source), "device": kwargs.get("device", "cpu"),
        "dtype": kwargs.get("dtype"), "kernels": kwargs.get("kernels", "auto"),
        "quantization": kwargs.get("quantization"), "grid": asdict(grid),
        "seconds": round(time.perf_counter() - started, 1), "fit": model.residuals(pairs),
        "machine": machine_info(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "samples": [{"batch": s.batch, "context": s.context, "chunk": s.chunk,
                     "phase": s.phase, **asdict(s.features), "seconds": round(s.seconds, 6)}
                    for s in samples]}
    return model, samples


def fit_grid(pairs: list[tuple[StepFeatures, float]]) -> LinearCost:
    """The calibration's fit of its samples: least squares with a knee if one pays for
    itself (`LinearCost.fit`).

    NOTE: large prefill chunks cost more a row (SmolLM2 on the 2-core AMX Xeon, two
    calibrations: past 322 and 416 rows, 0.20-0.24 ms a row more; a line priced their
    512-token chunks 7-13% short).
    """
    return LinearCost.fit(pairs, knee="auto")


def format_points(model: LinearCost, samples: list[Sample]) -> str:
    """Measured vs predicted per grid point (sum over its iterations)."""
    groups: dict[tuple[int, int, int, str], list[Sample]] = {}
    for s in samples:
        groups.setdefault((s.chunk, s.batch, s.context, s.phase), []).append(s)
    lines = [f"  {'chunk':>5} {'batch':>5} {'context':>7} {'phase':>7} {'iters':>5} "
             f"{'measured s':>10} {'predicted s':>11} {'ratio':>6}"]
    for (chunk, batch, context, phase), group in groups.items():
        measured = sum(s.seconds for s in group)
        predicted = sum(model.step_seconds(s.features) for s in group)
        lines.append(f"  {chunk:>5} {batch:>5} {context:>7} {phase:>7} {len(group):>5} "
                     f"{measured:>10.3f} {predicted:>11.3f} {predicted / measured:>6.2f}")
    return "\n".join(lines)


def format_residuals(fit: dict) -> str:
    return (f"  {fit['samples']} iterations: RMS {fit['rms_ms']:.2f} ms, relative error "
            f"median {fit['median_rel_error']:.1%}, p90 {fit['p90_rel_error']:.1%}, "
            f"max {fit['max_rel_error']:.1%}; total time off by {fit['total_rel_error']:.1%}")
