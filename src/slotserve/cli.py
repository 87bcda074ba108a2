"""`slotserve` command line: serve | generate | chat | bench | simulate | timeline."""

from __future__ import annotations

import argparse
import sys

from slotserve.config import KERNELS

SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20,
              "mb": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}


def parse_size(text: str) -> int:
    """'512M', '2GiB', '1073741824' -> bytes."""
    value = text.strip().lower()
    number = value.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = value[len(number):].strip()
    if unit not in SIZE_UNITS or not number:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512M, 2G)")
    return int(float(number) * SIZE_UNITS[unit])


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Flags shared by every command that builds an engine (names as engine_config's)."""
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="HF model directory or .gguf file (default: embedded SmolLM2-135M)")
    g.add_argument("--device", default="cpu", help="cpu or cuda")
    g.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    g.add_argument("--policy", default="continuous", choices=["continuous", "static"])
    g.add_argument("--max-num-seqs", type=int, default=32, help="slots in the running batch")
    g.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="token budget of one iteration")
    g.add_argument("--max-model-len", type=int, default=4096)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-blocks", type=int, default=None, help="KV pool size in blocks")
    g.add_argument("--kv-cache-memory", type=parse_size, default=None,
                   help="KV pool size in bytes (e.g. 1G); default: a share of free memory")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--quantization", default=None, choices=["int8", "bf16"],
                   help="int8: int8 weight-only linear layers on the CPU; bf16: the linear "
                        "layers' weights in bfloat16, fp32 compute (CPU; both opt-in, "
                        "greedy agreement with fp32 in benchmarks/PERF.md)")
    g.add_argument("--kernels", default="auto", choices=list(KERNELS),
                   help="auto: fastest verified kernels; mkl: the same but fp32 linears "
                        "through MKL's packed GEMM; reference: plain torch ops")


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(device=args.device, dtype=args.dtype, policy=args.policy,
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                max_model_len=args.max_model_len, block_size=args.block_size,
                num_blocks=args.num_blocks, kv_cache_memory=args.kv_cache_memory,
                seed=args.seed, quantization=args.quantization, kernels=args.kernels)


def cmd_generate(args: argparse.Namespace) -> int:
    from slotserve import LLM, SamplingParams

    llm = LLM(args.model, **engine_kwargs(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, seed=args.sample_seed)
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    else:
        out = llm.generate(args.prompt, params)[0]
    print(out.text)
    return 0


def add_generate_parser(subparsers) -> None:
    p = subparsers.add_parser("generate", help="complete one prompt and print the text")
    p.add_argument("prompt")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--sample-seed", type=int, default=None)
    add_engine_args(p)
    p.set_defaults(func=cmd_generate)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slotserve", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_generate_parser(subparsers)
    for module, names in _PLUGGED:
        mod = __import__(module, fromlist=names)
        for name in names:
            getattr(mod, name)(subparsers)
    return parser


# Subcommands defined next to the code they drive.
_PLUGGED: list[tuple[str, list[str]]] = [
    ("slotserve.lab.commands", ["add_simulate_parser", "add_timeline_parser"]),
    ("slotserve.lab.bench", ["add_bench_parser"]),
    ("slotserve.server.commands", ["add_serve_parser", "add_chat_parser"]),
]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"slotserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
