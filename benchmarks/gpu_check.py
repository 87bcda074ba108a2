"""The GPU machine's check of the engine and its Triton kernels, in one run of ~2-3 minutes.

Steps, each written to the JSON report as soon as it ends (a run cut short keeps the rest):
1. the machine: GPU, its multiprocessors and memory, torch / triton / CUDA versions;
2. tests/gpu on CUDA: the kernels compiled and checked against the torch path's ops (the same
   tests CI runs in Triton's interpreter on the CPU);
3. the HBM copy bandwidth: a 2 GiB device-to-device copy, bytes read + written / median time;
4. paged decode attention at Llama-3-8B's shape (32 query heads over 8 KV heads of 128,
   bf16, blocks of 16 scattered over the pool): the Triton kernel (num_warps 4 and 8; one
   split against flash-decoding's splits for a long context; 2 and 4 cache blocks a loop
   step instead of one) against the torch path (gather + SDPA,
   torch_paged.decode_attention) and dense SDPA over contiguous K/V (no paging); the KV
   bytes read / time against the copy bandwidth;
5. RMSNorm, add + RMSNorm, RoPE, SiLU-and-mul and the K/V write against the torch ops they
   replace, at 64 and 4096 tokens;
6. paged prefill attention at Llama-3.2-1B's and Llama-3.1-8B's head shapes (32 query heads
   over 8 KV heads of 64 / 128, bf16, blocks of 16 scattered over the pool): chunks of 256,
   512 and 2048 tokens after a cached prefix of 0 or 2048 positions, and 8 chunks of 256 in
   one iteration: gpu/triton_prefill.py's kernel (three tile shapes, and its key loop
   unpipelined; one launch for all chunks) against the torch path
   (torch_paged.paged_attention: SDPA over each chunk's gathered blocks with its mask,
   today's default) and dense causal SDPA over contiguous K/V (prefix 0: no paging, flash
   attention); attention TFLOP/s of the best Triton variant.
Times: triton.testing.do_bench's median (it clears the L2 before each call). Each Triton
result is also compared with its torch reference (relative error ||a - b|| / ||b||).

The engine on the device (benchmarks/gpu_engine.py, run first: `--parts`): HF equality in
fp32 and bf16, batch-1 TPOT against the bandwidth floor and full batches of 64 and 256 slots
with 1B- and 8B-shaped models, and their prefills with SDPA against the Triton prefill
attention. Results: benchmarks/GPU.md.

The GPU machine lacks two of slotserve's imports (llguidance, gguf); they travel as wheels
(the versions of the venv's). Here, once, from the repository root:

    echo /.whl/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \\
        --implementation cp --platform manylinux_2_31_x86_64 -d .whl llguidance==1.9.1
    python3 -m pip download --no-deps --only-binary=:all: -d .whl gguf==0.19.0

There (the device tool's run, carrying [".whl"]):

    python3 -m benchmarks.gpu_check --wheels .whl --out $OUT

`--dry-run` runs the engine and steps 3-5 at tiny sizes on the CPU through Triton's
interpreter (checks the script, times nothing meaningful); `--skip-tests` leaves step 2 out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SRC = REPO / "src"

# Llama-3-8B's attention and MLP shapes
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
HIDDEN, INTERMEDIATE = 4096, 14336
DECODE_CASES = [  # (sequences, context length, window)
    (1, 4096, None), (1, 32768, None), (8, 8192, None), (64, 2048, None), (256, 1024, None),
    (64, 8192, 4096)]
DRY_DECODE_CASES = [(2, 40, None), (1, 40, 20)]
TOKEN_COUNTS, DRY_TOKEN_COUNTS = (64, 4096), (3,)
PREFILL_HEAD_DIMS = {"llama-3.2-1b": 64, "llama-3.1-8b": 128}  # 32 heads over 8 KV heads
PREFILL_CASES = [  # (head shape, chunks, tokens per chunk, cached prefix)
    *((shape, 1, chunk, prefix) for shape in PREFILL_HEAD_DIMS for prefix in (0, 2048)
      for chunk in (256, 512, 2048)),
    *((shape, 8, 256, 2048) for shape in PREFILL_HEAD_DIMS)]
DRY_PREFILL_CASES = [("dry", 1, 5, 0), ("dry", 2, 3, 7)]
# launcher keywords: the defaults (128 rows x 64 keys, the key loop pipelined), other tiles,
# and the interpreter's unpipelined loop
PREFILL_TILES = {"triton_default": {}, "triton_m128_n32": dict(block_m=128, block_n=32),
                 "triton_m64_n64": dict(block_m=64, block_n=64),
                 "triton_while": dict(pipeline=False)}
TESTS_TIMEOUT_S = 270  # tests/gpu on CUDA (Triton compiles every kernel variant first)


class Report:
    """The JSON report, rewritten after every step."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S")}

    def step(self, name: str, fn, *args) -> None:
        start = time.perf_counter()
        try:
            self.data[name] = fn(*args)
        except Exception:  # one failed step must not lose the others
            self.data[name] = {"error": traceback.format_exc()[-4000:]}
        print(f"[{name}: {time.perf_counter() - start:.0f} s]", flush=True)
        self.path.write_text(json.dumps(self.data, indent=2) + "\n")


def install_wheels(folder: Path) -> str:
    """pip install the carried wheels into a temporary target; returns it (on sys.path)."""
    target = tempfile.mkdtemp(prefix="gpu-check-site-")
    wheels = sorted(str(p) for p in folder.glob("*.whl"))
    if wheels:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index",
                        "--no-deps", "--no-compile", "--target", target, *wheels], check=True)
    sys.path.insert(0, target)
    return target


def machine() -> dict:
    import torch
    import triton

    info = {"python": platform.python_version(), "torch": torch.__version__,
            "triton": triton.__version__, "cuda": torch.version.cuda,
            "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, multiprocessors=props.multi_processor_count,
                    memory_gib=round(props.total_memory / 2**30, 1),
                    capability=f"{props.major}.{props.minor}")
    return info


def run_tests(out_dir: Path, pythonpath: str) -> dict:
    """pytest tests/gpu in a subprocess; the root conftest (HF transformers' tiny models) is
    not loaded (--confcutdir)."""
    env = dict(os.environ, PYTHONPATH=pythonpath)
    env.pop("TRITON_INTERPRET", None)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               "--confcutdir", "tests/gpu", "tests/gpu", "--junitxml",
               str(out_dir / "tests-gpu.xml")]
    try:
        done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=TESTS_TIMEOUT_S)
    except subprocess.TimeoutExpired as expired:  # NOTE: what ran is kept, not lost
        output = (expired.stdout or b"").decode(errors="replace")
        return {"returncode": "timeout", "timeout_s": TESTS_TIMEOUT_S, "tail": output[-4000:]}
    output = done.stdout + done.stderr
    print(output[-3000:], flush=True)
    return {"returncode": done.returncode, "summary": output.strip().splitlines()[-1:],
            "tail": output[-4000:]}


class Timer:
    """Median milliseconds of fn(): do_bench on CUDA, one call on the CPU (dry run)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def __call__(self, fn) -> float:
        if self.cuda:
            from triton.testing import do_bench

            return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3


def rel_error(got, expected) -> float:
    got, expected = got.detach().double(), expected.detach().double()
    return float((got - expected).norm() / expected.norm().clamp_min(1e-30))


def copy_bandwidth(device, timer: Timer, dry: bool) -> dict:
    import torch

    nbytes = 2**20 if dry else 2 * 2**30
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    assert torch.equal(dst, src)
    return {"bytes_copied": nbytes, "ms": ms, "gb_per_s": 2 * nbytes / ms / 1e6}


def decode_attention_cases(device, timer: Timer, cases, copy_gbps: float | None) -> list:
    results = []
    for seqs, context, window in cases:
        results.append(decode_attention_case(device, timer, seqs, context, window, copy_gbps))
        print(json.dumps(results[-1]), flush=True)
    return results


def decode_attention_case(device, timer: Timer, seqs: int, context: int, window: int | None,
                          copy_gbps: float | None) -> dict:
    """`seqs` sequences of `context` positions each, their blocks scattered over the pool."""
    import torch
    import torch.nn.functional as F

    from slotserve.attention.metadata import DecodeGroup
    from slotserve.attention.torch_paged import decode_attention
    from slotserve.gpu import triton_ops as ops

    gen = torch.Generator(device="cpu").manual_seed(seqs + context)
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = seqs * blocks_per_seq + 1
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, dtype=torch.bfloat16, device=device)
    v_cache = torch.randn(shape, dtype=torch.bfloat16, device=device)
    tables = torch.randperm(num_blocks, generator=gen)[:seqs * blocks_per_seq]
    tables = tables.view(seqs, blocks_per_seq).to(device)
    lens = torch.full((seqs,), context, dtype=torch.int64, device=device)
    q = torch.randn(seqs, NUM_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device)
    scale = HEAD_DIM ** -0.5
    mask = torch.arange(blocks_per_seq * BLOCK_SIZE, device=device)[None] < lens[:, None]
    view = DecodeGroup(torch.arange(seqs, device=device), tables, lens, mask).windowed(
        window, BLOCK_SIZE)
    expected = decode_attention(q.float(), k_cache, v_cache, view.block_tables, view.mask,
                                scale)
    kv_bytes = 2 * seqs * min(context, window or context) * NUM_KV_HEADS * HEAD_DIM * 2
    row = {"seqs": seqs, "context": context, "window": window, "kv_bytes_read": kv_bytes,
           "splits": ops.num_decode_splits(blocks_per_seq, BLOCK_SIZE, window)[0]}
    variants = {f"triton_w{w}": dict(num_warps=w) for w in (4, 8)}
    # several cache blocks a loop step (not yet the default: DEFAULT_BLOCKS_PER_ITER)
    variants.update({f"triton_w8_b{b}": dict(num_warps=8, blocks_per_iter=b) for b in (2, 4)})
    if row["splits"] > 1:
        variants["triton_w4_one_split"] = dict(num_warps=4, partition_size=10**9)
    for name, kwargs in variants.items():
        def call(kwargs=kwargs):
            return ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale,
                                              window=window, **kwargs)
        row[f"{name}_rel_error"] = rel_error(call(), expected)
        row[f"{name}_ms"] = timer(call)
    row["torch_paged_ms"] = timer(lambda: decode_attention(
        q, k_cache, v_cache, view.block_tables, view.mask, scale))
    if window is None:  # dense: each sequence's K/V contiguous, no gather
        k = torch.randn(seqs, NUM_KV_HEADS, context, HEAD_DIM, dtype=torch.bfloat16,
                        device=device)
        dense_q = q.view(seqs, NUM_HEADS, 1, HEAD_DIM)
        row["dense_sdpa_ms"] = timer(lambda: F.scaled_dot_product_attention(
            dense_q, k, k, scale=scale, enable_gqa=True))
    best = min(row[f"{name}_ms"] for name in variants)
    row["triton_best_gb_per_s"] = kv_bytes / best / 1e6
    if copy_gbps:
        row["triton_best_of_copy_bandwidth"] = row["triton_best_gb_per_s"] / copy_gbps
    return row


def elementwise_cases(device, timer: Timer, token_counts) -> list:
    results = []
    for tokens in token_counts:
        for row in elementwise_case(device, timer, tokens):
            results.append(row)
            print(json.dumps(row), flush=True)
    return results


def elementwise_case(device, timer: Timer, tokens: int) -> list:
    """Each op at `tokens` tokens of Llama-3-8B's widths, bf16: Triton against torch."""
    import torch
    import torch.nn.functional as F

    from slotserve.attention.torch_paged import write_kv
    from slotserve.gpu import triton_ops as ops
    from slotserve.model.layers import RMSNorm, RotaryEmbedding, apply_rotary

    bf16 = torch.bfloat16
    norm = RMSNorm(HIDDEN, 1e-5).to(device=device, dtype=bf16)
    norm.weight.requires_grad_(False).normal_()
    rope = RotaryEmbedding(HEAD_DIM, 8192, 500_000.0).to(device)
    x = torch.randn(tokens, HIDDEN, dtype=bf16, device=device)
    delta = torch.randn_like(x)
    gate_up = torch.randn(tokens, 2 * INTERMEDIATE, dtype=bf16, device=device)
    qk = torch.randn(tokens, NUM_HEADS + NUM_KV_HEADS, HEAD_DIM, dtype=bf16, device=device)
    positions = torch.randint(0, 8192, (tokens,), device=device)
    kv = torch.randn(tokens, NUM_KV_HEADS, HEAD_DIM, dtype=bf16, device=device)
    pool_blocks = -(-tokens // BLOCK_SIZE) * 4
    caches = [torch.zeros(pool_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=bf16,
                          device=device) for _ in range(2)]
    slots = torch.randperm(pool_blocks * BLOCK_SIZE, device=device)[:tokens]

    def torch_add_norm():
        x.add_(delta)
        return norm(x)

    def torch_silu_mul():
        return F.silu(gate_up[:, :INTERMEDIATE]) * gate_up[:, INTERMEDIATE:]

    def torch_rotary():
        return qk.copy_(apply_rotary(qk, rope.tables(positions)))

    cases = {  # name: (triton, torch, bytes read + written)
        "rms_norm": (lambda: ops.rms_norm(x, norm.weight, 1e-5), lambda: norm(x),
                     2 * x.numel() * 2),
        "add_rms_norm": (lambda: ops.add_rms_norm_(x, delta, norm.weight, 1e-5),
                         torch_add_norm, 4 * x.numel() * 2),
        "silu_mul": (lambda: ops.silu_mul(gate_up), torch_silu_mul, gate_up.numel() * 3),
        "rotary": (lambda: ops.rotary_(qk, rope.cos, rope.sin, positions), torch_rotary,
                   2 * qk.numel() * 2),
        "write_kv": (lambda: ops.write_kv_(*caches, kv, kv, slots),
                     lambda: write_kv(*caches, kv, kv, slots), 4 * kv.numel() * 2),
    }
    errors = {
        "rms_norm": rel_error(ops.rms_norm(x, norm.weight, 1e-5), norm(x)),
        "silu_mul": rel_error(ops.silu_mul(gate_up), torch_silu_mul()),
        "rotary": rel_error(ops.rotary_(qk.clone(), rope.cos, rope.sin, positions),
                            apply_rotary(qk, rope.tables(positions))),
    }
    rows = []
    for name, (triton_fn, torch_fn, nbytes) in cases.items():
        row = {"op": name, "tokens": tokens, "bytes": nbytes,
               "triton_ms": timer(triton_fn), "torch_ms": timer(torch_fn)}
        row["triton_gb_per_s"] = nbytes / row["triton_ms"] / 1e6
        if name in errors:
            row["rel_error"] = errors[name]
        rows.append(row)
    return rows


def prefill_attention_cases(device, timer: Timer, cases) -> list:
    results = []
    for shape, chunks, tokens, prefix in cases:
        results.append(prefill_attention_case(device, timer, shape, chunks, tokens, prefix))
        print(json.dumps(results[-1]), flush=True)
    return results


def prefill_attention_case(device, timer: Timer, shape: str, chunks: int, tokens: int,
                           prefix: int) -> dict:
    """`chunks` prefill chunks of `tokens` new tokens each after `prefix` cached positions,
    one iteration's: the Triton kernel against the torch path (both over the same paged
    cache) and, without a prefix, dense causal SDPA."""
    import torch
    import torch.nn.functional as F

    from slotserve.attention.metadata import build_metadata
    from slotserve.attention.torch_paged import paged_attention
    from slotserve.config import SlotKind
    from slotserve.core.outputs import ScheduledSeq
    from slotserve.gpu import triton_prefill
    from slotserve.sampling import SamplingParams

    heads, kv_heads, head_dim = (4, 2, 16) if shape == "dry" else (
        NUM_HEADS, NUM_KV_HEADS, PREFILL_HEAD_DIMS[shape])
    context = prefix + tokens
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = chunks * blocks_per_seq + 1
    gen = torch.Generator(device="cpu").manual_seed(chunks * tokens + prefix)
    tables = torch.randperm(num_blocks, generator=gen)[:chunks * blocks_per_seq]
    tables = tables.view(chunks, blocks_per_seq).tolist()
    cache_shape = (num_blocks, BLOCK_SIZE, kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, dtype=torch.bfloat16, device=device)
    v_cache = torch.randn(cache_shape, dtype=torch.bfloat16, device=device)
    q = torch.randn(chunks * tokens, heads, head_dim, dtype=torch.bfloat16, device=device)
    params = SamplingParams(temperature=0.0)
    seqs = [ScheduledSeq(f"r{i}", list(range(tokens)), prefix, tables[i], True, params, 0,
                         SlotKind.PREFILL) for i in range(chunks)]
    meta = build_metadata(seqs, BLOCK_SIZE, device)
    scale = head_dim ** -0.5
    expected = paged_attention(q.float(), k_cache, v_cache, meta, scale)
    # causal: query i of a chunk sees prefix + i + 1 keys; QK^T and PV: 4 * hd FLOPs a pair
    pairs = chunks * heads * (tokens * prefix + tokens * (tokens + 1) // 2)
    row = {"shape": shape, "heads": [heads, kv_heads, head_dim], "chunks": chunks,
           "tokens": tokens, "prefix": prefix, "attention_flops": 4 * head_dim * pairs}
    out = torch.empty_like(q)
    for name, kwargs in PREFILL_TILES.items():
        kwargs = dict(kwargs)
        block_q = triton_prefill.tokens_per_tile(
            heads // kv_heads, kwargs.pop("block_m", triton_prefill.DEFAULT_BLOCK_M))
        batch = triton_prefill.metadata_batch(meta, block_q, device)

        def call(batch=batch, kwargs=kwargs):
            return triton_prefill.paged_prefill_attention(q, k_cache, v_cache, batch, scale,
                                                          out=out, **kwargs)
        row[f"{name}_rel_error"] = rel_error(call(), expected)
        row[f"{name}_ms"] = timer(call)
    row["torch_paged_ms"] = timer(lambda: paged_attention(q, k_cache, v_cache, meta, scale))
    if prefix == 0:  # each chunk's K/V contiguous: the flash kernel, no gather, no mask
        dense_q = q.view(chunks, tokens, heads, head_dim).transpose(1, 2)
        dense_k = torch.randn(chunks, kv_heads, tokens, head_dim, dtype=torch.bfloat16,
                              device=device)
        row["dense_sdpa_ms"] = timer(lambda: F.scaled_dot_product_attention(
            dense_q, dense_k, dense_k, is_causal=True, scale=scale, enable_gqa=True))
    best = min(row[f"{name}_ms"] for name in PREFILL_TILES)
    row["triton_best_tflops"] = row["attention_flops"] / best / 1e9
    row["triton_best_vs_torch_paged"] = row["torch_paged_ms"] / best
    return row


def engine_steps(report: Report, device, copy_gbps: float | None, dry: bool) -> None:
    """The engine on the device (benchmarks/gpu_engine.py): HF equality, then the speed of
    a 1B- and an 8B-shaped model (the dry run: a tiny one, on the CPU)."""
    from benchmarks import gpu_engine

    report.step("engine_hf_equality", gpu_engine.hf_equality, device, dry)
    if dry:
        report.step("engine_dry", gpu_engine.engine_speed, "dry", device, copy_gbps, (2, 4))
        report.step("engine_prefill_dry", gpu_engine.prefill_speed, "dry", device)
        return
    for shape in ("llama-3.2-1b", "llama-3.1-8b"):
        report.step(f"engine_{shape}", gpu_engine.engine_speed, shape, device, copy_gbps,
                    (64, 256), True)
        report.step(f"engine_prefill_{shape}", gpu_engine.prefill_speed, shape, device)


def summary(data: dict) -> str:
    lines = [f"machine: {data.get('machine')}",
             f"tests/gpu: {data.get('tests', {}).get('summary', data.get('tests'))}",
             f"copy bandwidth: {data.get('copy_bandwidth')}"]
    for row in data.get("decode_attention", []) if isinstance(
            data.get("decode_attention"), list) else []:
        lines.append(
            f"decode {row['seqs']:>3} x {row['context']:>5} window {row['window']}: triton "
            f"w4 {row['triton_w4_ms']:.3f} ms, w8 {row['triton_w8_ms']:.3f} ms, w8 2 blocks "
            f"{row['triton_w8_b2_ms']:.3f} ms, 4 blocks {row['triton_w8_b4_ms']:.3f} ms, "
            f"torch paged {row['torch_paged_ms']:.3f} ms, dense sdpa "
            f"{row.get('dense_sdpa_ms', float('nan')):.3f} ms; "
            f"{row['triton_best_gb_per_s']:.0f} GB/s, err {row['triton_w4_rel_error']:.1e}")
    for row in data.get("elementwise", []) if isinstance(data.get("elementwise"), list) else []:
        lines.append(f"{row['op']:>12} x {row['tokens']:>4}: triton {row['triton_ms']:.4f} ms "
                     f"({row['triton_gb_per_s']:.0f} GB/s), torch {row['torch_ms']:.4f} ms")
    prefill = data.get("prefill_attention")
    for row in prefill if isinstance(prefill, list) else []:
        tiles = ", ".join(f"{name.removeprefix('triton_')} {row[f'{name}_ms']:.3f} ms"
                          for name in PREFILL_TILES)
        lines.append(
            f"prefill {row['shape']} {row['chunks']} x {row['tokens']:>4} after "
            f"{row['prefix']:>4}: triton {tiles}, torch paged {row['torch_paged_ms']:.3f} ms, "
            f"dense sdpa {row.get('dense_sdpa_ms', float('nan')):.3f} ms; "
            f"{row['triton_best_tflops']:.0f} TFLOP/s, "
            f"err {row['triton_default_rel_error']:.1e}")
    for name, value in data.items():
        if name.startswith("engine_") and isinstance(value, dict) and "error" not in value:
            lines.append(f"{name}: {json.dumps(value)}")
    errors = [name for name, value in data.items()
              if isinstance(value, dict) and "error" in value]
    if errors:
        lines.append(f"FAILED steps: {errors} (tracebacks in the JSON)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get(
        "OUT", REPO / "benchmarks" / "results")), help="folder for gpu-check.json")
    parser.add_argument("--wheels", type=Path, default=None,
                        help="a folder of wheels to install first (no index)")
    parser.add_argument("--skip-tests", action="store_true", help="leave tests/gpu out")
    parser.add_argument("--parts", default="engine,tests,kernels",
                        help="which parts to run, in this order: real (--model on the engine and "
                             "in HF), engine (random models on the device), tests "
                             "(tests/gpu), kernels (the kernels' timings)")
    parser.add_argument("--model", default=None,
                        help="a real model's .gguf for the part 'real' (HF equality on it)")
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny sizes on the CPU in Triton's interpreter (a script check)")
    args = parser.parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton_ops is imported
    pythonpath = [str(SRC)]
    if args.wheels is not None:
        pythonpath.insert(0, install_wheels(args.wheels))
    sys.path.insert(0, str(SRC))
    import torch

    args.out.mkdir(parents=True, exist_ok=True)
    report = Report(args.out / ("gpu-check-dry.json" if args.dry_run else "gpu-check.json"))
    report.step("machine", machine)
    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device: use --dry-run on a CPU", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.dry_run else "cuda")
    timer = Timer(cuda=not args.dry_run)
    report.step("copy_bandwidth", copy_bandwidth, device, timer, args.dry_run)
    copy_gbps = report.data["copy_bandwidth"].get("gb_per_s")
    parts = set(args.parts.split(","))
    if "real" in parts and args.model:
        from benchmarks import gpu_engine

        report.step("engine_real_model", gpu_engine.real_model_equality, args.model, device)
    if "engine" in parts:
        engine_steps(report, device, copy_gbps, args.dry_run)
    if "tests" in parts and not args.skip_tests and not args.dry_run:
        report.step("tests", run_tests, args.out, os.pathsep.join(pythonpath))
    if "kernels" in parts:
        report.step("decode_attention", decode_attention_cases, device, timer,
                    DRY_DECODE_CASES if args.dry_run else DECODE_CASES, copy_gbps)
        report.step("elementwise", elementwise_cases, device, timer,
                    DRY_TOKEN_COUNTS if args.dry_run else TOKEN_COUNTS)
        report.step("prefill_attention", prefill_attention_cases, device, timer,
                    DRY_PREFILL_CASES if args.dry_run else PREFILL_CASES)
    print(summary(report.data))
    failed = any(isinstance(v, dict) and ("error" in v or v.get("returncode"))
                 for v in report.data.values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
