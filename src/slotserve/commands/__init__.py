"""The subcommands of `slotserve`, one module each: its argparse definition (`add_*_parser`)
and the function it runs (`cmd_*` / `run_*`, returning the exit code). `common` holds what
several of them share. `slotserve.cli` registers them.

NOTE: the top layer: a command may import anything below it; nothing imports a command
except `slotserve.cli` (tests/unit/test_layering.py)."""
