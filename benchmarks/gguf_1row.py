"""The GGUF block kernel at batch 1: GB/s per layer role against the memory's, and ms/token.

    .venv/bin/python -m benchmarks.gguf_1row \
        --model /tmp/quant-bench/llama-3.2-1b-shaped-random-q4_k_m.gguf

Loads the file as `LLM(model=path)` does (quantization auto: the file's own blocks), then, in
this one process:
- the memory's pace: a 256 MiB copy (read + written bytes / s) and a 256 MiB fp32 sum (read
  bytes / s), both on every torch thread;
- per layer role (qkv, o, gate_up, down, lm_head) and code format: one 1-row call of each
  layer's kernel in turn (all layers: together they do not fit the caches, as in a decode
  step), the median pass of `--passes`: ms and GB/s (the kernels' held bytes / time);
- the whole batch-1 decode step: greedy decode of `--tokens` tokens, median step ms;
- `--rows 1 64`: the per-role passes at 1 and 64 rows; `--batch 64`: the median decode step
  of 64 sequences together (no regression for batched decode).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

COPY_BYTES = 256 << 20


def _median_s(fn, passes: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(passes):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def memory_pace(passes: int) -> dict:
    """GB/s of a copy (bytes read + written) and of a sum (bytes read)."""
    src = torch.ones(COPY_BYTES // 4)
    dst = torch.empty_like(src)
    copy_s = _median_s(lambda: dst.copy_(src), passes)
    sum_s = _median_s(lambda: src.sum(), passes)
    return {"copy_gb_s": 2 * COPY_BYTES / copy_s / 1e9, "sum_read_gb_s": COPY_BYTES / sum_s / 1e9}


def kernels_by_role(model) -> dict[str, list]:
    """role (qkv, o, gate_up, down, lm_head) + the kernel's code bits -> its layers' kernels."""
    from slotserve.model.layers import Linear

    roles: dict[str, list] = {}
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or module.kernel is None:
            continue
        role = name.rsplit(".", 1)[-1]
        segments = getattr(module.kernel, "segments", [module.kernel])  # SegmentedLinear's
        for i, kernel in enumerate(segments):
            part = f"[{i}]" if len(segments) > 1 else ""
            key = f"{role}{part} {kernel.out_features}x" \
                  f"{kernel.block_len * kernel.codes.shape[1]} bits={kernel.bits} " \
                  f"L={kernel.block_len} {'+'.join(kernel.types)}"
            roles.setdefault(key, []).append(kernel)
    return roles


def role_passes(roles: dict[str, list], rows: int, passes: int) -> dict:
    from slotserve.model.linear_kernels import held_bytes

    torch.manual_seed(0)
    result = {}
    for key, kernels in roles.items():
        xs = [torch.randn(rows, k.block_len * k.codes.shape[1]) for k in kernels]
        held = sum(held_bytes(k) for k in kernels)
        pairs = list(zip(kernels, xs))
        seconds = _median_s(lambda pairs=pairs: [k(x) for k, x in pairs], passes)
        result[key] = {"layers": len(kernels), "ms": seconds * 1e3,
                       "mib": held / 2**20, "gb_s": held / seconds / 1e9}
    return result


class _Timed:
    """A callable wrapped to add its wall time to `total` (seconds)."""

    def __init__(self, fn) -> None:
        self.fn, self.total = fn, 0.0

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.total += time.perf_counter() - start


def decode_ms_per_token(llm, tokens: int) -> dict:
    """Median step ms of one greedy sequence, and the mean ms per step of the decode stack's
    forward (every layer) and of the LM head; the rest is the engine's own."""
    from slotserve.sampling import SamplingParams

    engine = llm.engine
    model = engine.runner.model
    stack, head = _Timed(model.decode_stack.forward), _Timed(model.lm_head.kernel)
    model.decode_stack = _StackProxy(model.decode_stack, stack)
    model.lm_head.kernel = _KernelProxy(model.lm_head.kernel, head)
    engine.add_request("b1", [1, 2, 3, 4], SamplingParams(max_tokens=tokens, temperature=0.0,
                                                          ignore_eos=True))
    engine.step()  # prefill
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
        if len(times) == 2:
            stack.total = head.total = 0.0
    steps = len(times) - 2
    return {"step_ms_median": statistics.median(times[2:]) * 1e3,
            "step_ms_mean": statistics.mean(times[2:]) * 1e3,
            "stack_ms_mean": stack.total / steps * 1e3, "lm_head_ms_mean": head.total / steps * 1e3}


def batched_step_ms(llm, seqs: int, tokens: int) -> float:
    """Median ms of a decode step with `seqs` greedy sequences decoding together."""
    from slotserve.sampling import SamplingParams

    engine = llm.engine
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    for i in range(seqs):
        engine.add_request(f"w{i}", [1, 2 + i % 50, 3, 4], params)
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        outputs = engine.step()
        if engine.scheduler.num_waiting == 0 and len(outputs) == seqs:  # all decoding
            times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) * 1e3


class _StackProxy:
    def __init__(self, stack, forward) -> None:
        self._stack, self.forward = stack, forward

    def __getattr__(self, name):
        return getattr(self._stack, name)


class _KernelProxy:
    def __init__(self, kernel, call) -> None:
        self._kernel, self._call = kernel, call

    def __call__(self, x):
        return self._call(x)

    def __getattr__(self, name):
        return getattr(self._kernel, name)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--passes", type=int, default=15)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rows", type=int, nargs="*", default=[1])
    p.add_argument("--no-roles", action="store_true", help="only the decode step")
    p.add_argument("--batch", type=int, default=0,
                   help="also the median decode step of this many sequences together")
    p.add_argument("--out", default=None)
    args = p.parse_args()

    import slotserve
    from slotserve.engine.llm import LLM

    llm = LLM(model=args.model, max_num_seqs=max(8, args.batch), num_blocks=1024)
    model = llm.engine.runner.model
    result = {"slotserve": slotserve.__file__, "cpu": platform.processor(),
              "threads": torch.get_num_threads(), "memory": memory_pace(args.passes)}
    if not args.no_roles:
        roles = kernels_by_role(model)
        for rows in args.rows:
            result[f"roles_{rows}_rows"] = role_passes(roles, rows, args.passes)
    result["batch1_ms_per_token"] = decode_ms_per_token(llm, args.tokens)
    if args.batch:
        result[f"step_ms_{args.batch}_seqs"] = batched_step_ms(llm, args.batch, args.tokens)
    result["memory_after"] = memory_pace(args.passes)
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
