"""`slotserve calibrate`: time real engine iterations, fit the replay's cost model."""

from __future__ import annotations

import argparse

from slotserve.commands.common import int_tuple


def add_calibrate_parser(subparsers) -> argparse.ArgumentParser:
    """`slotserve calibrate`: time real iterations, fit the replay's cost model."""
    from slotserve.config import DEFAULT_QUANTIZATION, KERNELS, QUANTIZATIONS

    p = subparsers.add_parser(
        "calibrate", help="time real engine iterations and fit the simulator's cost model",
        description="Time real engine iterations over a grid of batch sizes, context lengths "
                    "and chunk sizes; fit seconds = base + a*prefill tokens + b*decode seqs "
                    "+ c*attention pairs + d*sampled rows + e*chunks (sequences attended one "
                    "at a time beside prefills) + f*decode pairs (a decode's pairs, read "
                    "from the KV cache: on top of c) + g in an engine's first forward + "
                    "h*decodes beside a prefill chunk (on top of b), with a knee over rows "
                    "if one pays for itself; a fresh engine for every grid point, which "
                    "also times a prompt prefilled beside decodes; print the fit and its "
                    "residuals; "
                    "write the profile for `slotserve replay/plan --profile` (and keep it "
                    "as this machine's last calibration, `slotserve replay`'s default).")
    p.add_argument("--out", metavar="PROFILE.json", default="profile.json")
    p.add_argument("--batch-sizes", type=int_tuple, default=None, metavar="B,B,...")
    p.add_argument("--context-lens", type=int_tuple, default=None, metavar="L,L,...")
    p.add_argument("--chunk-sizes", type=int_tuple, default=None, metavar="C,C,...")
    p.add_argument("--decode-steps", type=int, default=None)
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    g.add_argument("--device", default="cpu")
    g.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    g.add_argument("--kernels", default="auto", choices=list(KERNELS))
    g.add_argument("--quantization", default=DEFAULT_QUANTIZATION, choices=QUANTIZATIONS,
                   help=f"weights, as `slotserve serve`'s (default: {DEFAULT_QUANTIZATION})")
    g.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_calibrate)
    return p


def remember_calibration(model) -> None:
    """Keep the profile as this machine's last calibration: `slotserve replay`'s clock."""
    from slotserve.paths import last_calibration_path

    path = last_calibration_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    model.save(path)
    print(f"wrote {path} (`slotserve replay`'s default clock)")


def cmd_calibrate(args: argparse.Namespace) -> int:
    from slotserve.lab.bench.targets import EngineTarget
    from slotserve.lab.replay.calibrate import (
        CalibrationGrid,
        calibrate,
        format_points,
        format_residuals,
    )

    overrides = {k: getattr(args, k) for k in ("batch_sizes", "context_lens", "chunk_sizes",
                                                "decode_steps") if getattr(args, k) is not None}
    grid = CalibrationGrid(**overrides)
    target = EngineTarget.load(args.model, device=args.device, dtype=args.dtype,
                               kernels=args.kernels, quantization=args.quantization,
                               seed=args.seed)
    print(f"calibrating {target.source} on {args.device} (kernels {args.kernels})")
    model, samples = calibrate(target, grid, seed=args.seed, log=print)
    print("fit (seconds per iteration = base + sum of coefficient x feature):")
    print(model.format())
    print("residuals:")
    print(format_residuals(model.meta["fit"]))
    print(format_points(model, samples))
    model.save(args.out)
    print(f"wrote {args.out} ({model.meta['seconds']} s)")
    remember_calibration(model)
    return 0
