"""What a JSON schema costs: output tok/s of a batch with structured outputs vs free text.

    PYTHONPATH=src python -m benchmarks.structured_cost --rounds 3 --out

One engine in process (the embedded SmolLM2-135M unless --model), one batch of `--requests`
chat requests (16) sent at once, the same prompts both ways, `--max-tokens` each with
ignore_eos: a free run and a run under a JSON schema, interleaved (free, schema, free,
schema, ...) for `--rounds` rounds so that a drift of the host's speed falls on both sides.
The schema needs a long output (at least `--max-tokens` tokens, see schema_for), so its
grammar never ends a completion early and both sides produce the same number of tokens; the
tokens actually produced are counted and reported all the same.

Per round: output tok/s of each side (tokens produced / wall time of the batch), the ratio
schema / free (the target is >= 0.85) and, for the schema side, the time the runner's mask
worker spent computing the allowed-token masks (it overlaps the forward) and the time each
step waited for them after the forward. NOTE: the engine does not report mask times; this
script times the runner's `_compute_masks` and the wait on its future by wrapping them
(`MaskTimer`), and reports them as null if the runner no longer has those methods.

A warm-up batch of each kind runs first (it compiles the schema's grammar and builds the
tokenizer's vocabulary for the grammar engine, which later requests take from the cache).
`--out [PATH]` writes the JSON report (default: benchmarks/results/structured-cost.json);
without it nothing is written.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from slotserve import SamplingParams
from slotserve.engine.llm import LLM
from slotserve.lab.bench.report import write_report
from slotserve.structured import StructuredOutputs

DEFAULT_OUT = "benchmarks/results/structured-cost.json"
TARGET_RATIO = 0.85  # schema tok/s / free tok/s, the target
TOPICS = ("a book club", "a football team", "a chess club", "a choir", "a startup",
          "a hospital ward", "a school class", "a film crew", "a band", "a lab",
          "a kitchen", "a newsroom", "a ship's crew", "a garden club", "a climbing team",
          "a library")


def schema_for(max_tokens: int) -> dict:
    """People with a name, an age and a city: at least max_tokens // 2 + 1 of them, so no
    valid output is shorter than max_tokens tokens. NOTE: SmolLM2's tokenizer writes each
    digit as a token of its own, so each person takes at least two tokens (the age's digit
    and the text between two ages), however the rest merges."""
    person = {"type": "object",
              "properties": {"name": {"type": "string", "maxLength": 24},
                             "age": {"type": "integer", "minimum": 0, "maximum": 120},
                             "city": {"type": "string", "maxLength": 24}},
              "required": ["name", "age", "city"], "additionalProperties": False}
    return {"type": "object",
            "properties": {"people": {"type": "array", "items": person,
                                      "minItems": max_tokens // 2 + 1}},
            "required": ["people"], "additionalProperties": False}


def prompts_for(llm: LLM, count: int) -> list[list[int]]:
    """`count` chat prompts asking for the members of a group as JSON."""
    tokenizer = llm.tokenizer
    return [tokenizer.encode_chat([{"role": "user", "content": (
        f"List the members of {TOPICS[i % len(TOPICS)]} as JSON: an object with a "
        "\"people\" array of {name, age, city}.")}], add_generation_prompt=True)
            for i in range(count)]


class MaskTimer:
    """Times the runner's allowed-token masks: the worker's compute time and the step's wait
    for them after the forward (wrapping private methods; None where they are gone)."""

    def __init__(self, runner) -> None:
        self.compute_s = 0.0
        self.wait_s = 0.0
        self.steps = 0
        self.available = all(hasattr(runner, name) for name in ("_compute_masks",
                                                                 "_start_masks"))
        if self.available:
            self._wrap(runner)

    def _wrap(self, runner) -> None:
        compute, start = runner._compute_masks, runner._start_masks

        def timed_compute(rows):
            t0 = time.perf_counter()
            try:
                return compute(rows)
            finally:
                self.compute_s += time.perf_counter() - t0

        def timed_start(sampling):
            future = start(sampling)
            return None if future is None else _TimedFuture(future, self)

        runner._compute_masks, runner._start_masks = timed_compute, timed_start

    def reset(self) -> None:
        self.compute_s = self.wait_s = 0.0
        self.steps = 0

    def report(self) -> dict:
        if not self.available:
            return {"mask_compute_s": None, "mask_wait_s": None, "masked_steps": None}
        return {"mask_compute_s": self.compute_s, "mask_wait_s": self.wait_s,
                "masked_steps": self.steps}


class _TimedFuture:
    """A mask future whose result() adds the time it waited to its MaskTimer."""

    def __init__(self, future, timer: MaskTimer) -> None:
        self._future, self._timer = future, timer

    def result(self):
        t0 = time.perf_counter()
        try:
            return self._future.result()
        finally:
            self._timer.wait_s += time.perf_counter() - t0
            self._timer.steps += 1


def run_batch(llm: LLM, prompts: list[list[int]], params: SamplingParams,
              timer: MaskTimer) -> dict:
    """One batch, all sent at once: tokens produced, wall time, tok/s, mask times."""
    timer.reset()
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    reasons = sorted({o.outputs[0].finish_reason for o in outputs})
    return {"output_tokens": tokens, "seconds": seconds, "output_tok_s": tokens / seconds,
            "finish_reasons": reasons, "sample": outputs[0].outputs[0].text[:160],
            **timer.report()}


def run_rounds(llm: LLM, requests: int, max_tokens: int, rounds: int,
               temperature: float = 0.0, log=print) -> dict:
    """Warm up, then `rounds` of (free, schema); each round's sides, ratio, and the median."""
    prompts = prompts_for(llm, requests)
    schema = schema_for(max_tokens)
    common = dict(max_tokens=max_tokens, ignore_eos=True, temperature=temperature, seed=0)
    sides = {"free": SamplingParams(**common),
             "schema": SamplingParams(**common, structured_outputs=StructuredOutputs(json=schema))}
    timer = MaskTimer(llm.engine.runner)
    t0 = time.perf_counter()
    for params in sides.values():  # warm-up: compiles the grammar, builds the vocabulary
        run_batch(llm, prompts[:2], params, timer)
    warmup_s = time.perf_counter() - t0
    results = []
    for number in range(1, rounds + 1):
        row = {"round": number}
        for name, params in sides.items():
            row[name] = run_batch(llm, prompts, params, timer)
            log(f"round {number} {name}: {row[name]['output_tokens']} tokens in "
                f"{row[name]['seconds']:.2f} s, {row[name]['output_tok_s']:.1f} out tok/s")
        row["ratio"] = row["schema"]["output_tok_s"] / row["free"]["output_tok_s"]
        log(f"round {number} ratio schema/free: {row['ratio']:.3f}")
        results.append(row)
    median = statistics.median(r["ratio"] for r in results)
    return {"requests": requests, "max_tokens": max_tokens, "temperature": temperature,
            "schema": schema, "warmup_s": warmup_s, "rounds": results, "median_ratio": median,
            "target_ratio": TARGET_RATIO, "met": median >= TARGET_RATIO}


def format_summary(report: dict) -> str:
    """A table of the rounds and the median ratio against the target."""
    lines = ["| round | free tok/s | schema tok/s | ratio | mask compute s | mask wait s |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in report["rounds"]:
        s = r["schema"]
        masks = ("-", "-") if s["mask_compute_s"] is None else (
            f"{s['mask_compute_s']:.3f}", f"{s['mask_wait_s']:.3f}")
        lines.append(f"| {r['round']} | {r['free']['output_tok_s']:.1f} | "
                     f"{s['output_tok_s']:.1f} | {r['ratio']:.3f} | {masks[0]} | {masks[1]} |")
    lines.append(f"median ratio {report['median_ratio']:.3f} (target >= {TARGET_RATIO}): "
                 f"{'met' if report['met'] else 'NOT met'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    p.add_argument("--rounds", type=int, default=3, help="(free, schema) pairs (default 3)")
    p.add_argument("--requests", type=int, default=16, help="batch size (default 16)")
    p.add_argument("--max-tokens", type=int, default=128,
                   help="output tokens per request, with ignore_eos (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="default 0 (greedy)")
    p.add_argument("--out", metavar="JSON", nargs="?", const=DEFAULT_OUT,
                   help=f"write the JSON report (to {DEFAULT_OUT} if no path is given; "
                        "without --out nothing is written)")
    args = p.parse_args(argv)
    for name in ("rounds", "requests", "max_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    llm = LLM(args.model, **_engine_settings(args))
    report = run_rounds(llm, args.requests, args.max_tokens, args.rounds, args.temperature,
                        log=lambda line: print(line, file=sys.stderr, flush=True))
    print(format_summary(report))
    if args.out:
        write_report(args.out, engine=_engine_settings(args), model=args.model or "embedded",
                     **report)
        print(f"wrote {args.out}")
    return 0


def _engine_settings(args: argparse.Namespace) -> dict:
    """The whole batch runs at once; room for the prompt (under 100 tokens) and the output."""
    return {"max_num_seqs": args.requests, "max_model_len": args.max_tokens + 256}


if __name__ == "__main__":
    sys.exit(main())
