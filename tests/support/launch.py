"""The tests' server launcher: `slotserve.lab.bench.server` (benchmarks use it too)."""

from slotserve.lab.bench.server import (  # noqa: F401
    HOST,
    STARTUP_TIMEOUT_S,
    STOP_TIMEOUT_S,
    ServerProcess,
    ServerStartError,
    cli_flags,
    free_port,
    healthy,
    scrape_metrics,
    wait_healthy,
)
