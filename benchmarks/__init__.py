"""slotserve's benchmarks, run from the repository root as modules: `python -m benchmarks.perf`.

benchmarks/README.md indexes each script, the result files it writes and the section that
reports them.
"""
