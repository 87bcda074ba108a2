"""Replicas on Ray Serve: 2 replicas x 1 thread vs 1 engine x 2 threads, the router policies
on a multi-turn workload, and the router's cost per request.

    PYTHONPATH=src python -m benchmarks.replicas --out benchmarks/results/replicas.json

In-process (no HTTP on either side, so the comparison is of the engines and the routing):
the single engine is an AsyncEngine in this process; the replicas are Serve deployments
behind a ReplicaFront (what `slotserve serve --replicas 2` serves). Greedy, ignore_eos,
random token prompts on the default model (or --model).

Workloads:
- W: `--requests` requests at once, `--prompt-len` tokens each, `--output-len` out.
- multi-turn: `--conversations` conversations at once, `--turns` turns each (a turn's
  prompt: the last prompt + its answer + a new message of `--message-len` tokens; each
  starts with one shared system prompt of `--system-len` tokens), one conversation's turns
  one after the other.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import tempfile
import time

from slotserve.percentile import percentile
from slotserve.sampling import SamplingParams

VOCAB_LOW, VOCAB_HIGH = 100, 40_000


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(n)]


async def _one(engine, request_id: str, prompt: list[int], max_tokens: int) -> dict:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start, ttft, final = time.perf_counter(), None, None
    async for out in engine.generate(request_id, prompt, params):
        if ttft is None:
            ttft = time.perf_counter() - start
        final = out
    return {"ttft": ttft, "tokens": len(final.outputs[0].token_ids), "ids": final.token_ids}


async def run_w(engine, args) -> dict:
    rng = random.Random(1)
    prompts = [_tokens(rng, args.prompt_len) for _ in range(args.requests)]
    start = time.perf_counter()
    results = await asyncio.gather(*(_one(engine, f"w{i}", p, args.output_len)
                                     for i, p in enumerate(prompts)))
    return _summary(results, time.perf_counter() - start)


async def run_multi_turn(engine, args, seed: int = 2) -> dict:
    rng = random.Random(seed)
    system = _tokens(rng, args.system_len)
    messages = [[_tokens(rng, args.message_len) for _ in range(args.turns)]
                for _ in range(args.conversations)]

    async def conversation(c: int) -> list[dict]:
        prompt, results = list(system), []
        for t, message in enumerate(messages[c]):
            prompt = prompt + message
            result = await _one(engine, f"c{c}t{t}", prompt, args.output_len)
            prompt = prompt + result["ids"]
            results.append(result)
        return results

    start = time.perf_counter()
    per_conversation = await asyncio.gather(*(conversation(c)
                                              for c in range(args.conversations)))
    return _summary([r for rs in per_conversation for r in rs], time.perf_counter() - start)


def _summary(results: list[dict], seconds: float) -> dict:
    ttfts = [r["ttft"] for r in results]
    tokens = sum(r["tokens"] for r in results)
    return {"requests": len(results), "seconds": round(seconds, 3),
            "output_tokens_per_s": round(tokens / seconds, 1),
            "ttft_p50_ms": round(percentile(ttfts, 50) * 1000, 1),
            "ttft_p99_ms": round(percentile(ttfts, 99) * 1000, 1)}


def _hit_rate(before: dict, after: dict) -> float:
    queries = after["queries"] - before["queries"]
    return round((after["hits"] - before["hits"]) / queries, 3) if queries else 0.0


# --------------------------------------------------------------------------- runs
def single_engine(args) -> dict:
    import torch

    from slotserve.engine.async_engine import AsyncEngine
    from slotserve.engine.llm import engine_config
    from slotserve.engine.llm_engine import LLMEngine

    def build() -> LLMEngine:
        built = LLMEngine.from_config(engine_config(args.model, **_engine_kwargs(args)))
        torch.set_num_threads(2)
        return built

    async_engine = AsyncEngine.launch(build)  # NOTE: built in its thread (launch's NOTE)
    engine = async_engine.engine

    def counters() -> dict:
        return {"hits": engine.stats.prefix_cache_hits,
                "queries": engine.stats.prefix_cache_queries}

    try:
        w = asyncio.run(run_w(async_engine, args))
        before = counters()
        mt = asyncio.run(run_multi_turn(async_engine, args))
        mt["prefix_hit_rate"] = _hit_rate(before, counters())
    finally:
        async_engine.stop()
    return {"W": w, "multi_turn": mt}


def replicas(args) -> dict:
    import ray
    from ray import serve

    from slotserve.scaleout.launch import build_front, deploy_replicas, start_ray
    from slotserve.scaleout.replica import ReplicaSpec

    temp_dir = tempfile.mkdtemp(prefix="/tmp/ray-bench-")
    start_ray(None, num_cpus=2, temp_dir=temp_dir)
    out: dict = {}
    try:
        handles = deploy_replicas(ReplicaSpec(args.model, _engine_kwargs(args), threads=1), 2)

        def counters() -> dict:
            snaps = [h.snapshot.remote().result() for h in handles.values()]
            return {"hits": sum(s["engine"].prefix_cache_hits for s in snaps),
                    "queries": sum(s["engine"].prefix_cache_queries for s in snaps)}

        front = build_front(handles, "round_robin")
        out["W"] = asyncio.run(run_w(front, args))
        out["multi_turn"] = {}
        for turn, policy in enumerate(("prefix", "least_loaded", "round_robin")):
            front = build_front(handles, policy)
            before = counters()
            # NOTE: each policy gets new prompts (another seed): no hits on an earlier run's
            result = asyncio.run(run_multi_turn(front, args, seed=2 + turn))
            result["prefix_hit_rate"] = _hit_rate(before, counters())
            out["multi_turn"][policy] = result
    finally:
        serve.shutdown()
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
    return out


def router_cost(block_size: int = 16) -> dict:
    """Microseconds per Router.pick (prefix policy, 2 replicas) by prompt length."""
    from slotserve.scaleout.router import Router

    rng = random.Random(3)
    costs = {}
    for length in (128, 1024, 4096):
        router = Router(["a", "b"], block_size, "prefix")
        prompts = [_tokens(rng, length) for _ in range(200)]
        start = time.perf_counter()
        for p in prompts:
            router.pick(p, {"a": 0, "b": 0})
        costs[f"{length}_tokens_us"] = round((time.perf_counter() - start) / len(prompts) * 1e6,
                                             1)
    return costs


def _engine_kwargs(args) -> dict:
    return dict(max_num_seqs=args.max_num_seqs, max_model_len=1024, num_blocks=args.num_blocks,
                block_size=16, seed=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-len", type=int, default=32)
    parser.add_argument("--message-len", type=int, default=48)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=1024)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    results = {"router_cost": router_cost(), "single_engine_2_threads": single_engine(args),
               "replicas_2x1_thread": replicas(args), "args": vars(args)}
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
