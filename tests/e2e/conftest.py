"""A real `slotserve serve` subprocess on 127.0.0.1 (a free port), one per test module.

The main server and the in-process offline LLM (the oracle for greedy outputs) share
ENGINE_FLAGS; the oracle loads while the server starts.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.support import launch
from tests.support.launch import STARTUP_TIMEOUT_S, cli_flags, free_port, scrape_metrics

REPO = Path(__file__).resolve().parents[2]
MODEL_NAME = "SmolLM2-135M-Instruct"
# A small pool and context keep memory and startup low; the same settings for the oracle.
# NOTE: fp32 weights (quantization="none"): the server's outputs under load are compared
# with the offline API's to the token, which bf16's AMX path (batch-size dependent) breaks.
ENGINE_FLAGS = dict(max_num_seqs=32, max_num_batched_tokens=512, max_model_len=512,
                    num_blocks=512, block_size=16, seed=0, quantization="none")


class ServerProcess(launch.ServerProcess):
    """The launched server plus what the tests ask of it: openai clients, /metrics."""

    def client(self, **kwargs):
        import openai

        return openai.OpenAI(base_url=self.base_url, api_key="x", max_retries=0, **kwargs)

    def async_client(self, **kwargs):
        import openai

        return openai.AsyncOpenAI(base_url=self.base_url, api_key="x", max_retries=0, **kwargs)

    def metrics(self) -> dict[str, float]:
        """Samples of /metrics: 'name' or 'name{label="value"}' -> value."""
        return scrape_metrics(self.url)

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        try:
            super().wait_ready(timeout)
        except launch.ServerStartError as e:
            pytest.fail(str(e))


def launch_server(log_dir: Path, *flags: str) -> ServerProcess:
    """Start `python -m slotserve.cli serve` (not waiting for it to be ready)."""
    port = free_port()
    return ServerProcess.launch(log_dir / f"server-{port}.log", *flags, port=port, cwd=REPO)


@contextmanager
def running_server(log_dir: Path, *flags: str) -> Iterator[ServerProcess]:
    """A launched server, ready (a failed start fails the test); stopped when the block ends,
    however it ends. A module's own server fixture: `with running_server(...) as proc: yield
    proc`."""
    proc = launch_server(log_dir, *flags)
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="session")
def offline_llm():
    """The offline API on the same model and engine settings as the server."""
    from slotserve import LLM

    return LLM(**ENGINE_FLAGS)


@pytest.fixture(scope="module")
def server(request, tmp_path_factory):
    """The main server; the offline LLM loads while it starts."""
    proc = launch_server(tmp_path_factory.mktemp("server"), *cli_flags(**ENGINE_FLAGS))
    try:
        request.getfixturevalue("offline_llm")
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def client(server):
    """An openai client of the module's `server` (a module's own server fixture included)."""
    return server.client()
