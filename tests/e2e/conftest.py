"""A real `slotserve serve` subprocess on 127.0.0.1 (a free port), one per test module.

The main server and the in-process offline LLM (the oracle for greedy outputs) share
ENGINE_FLAGS; the oracle loads while the server starts.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[2]
MODEL_NAME = "SmolLM2-135M-Instruct"
# A small pool and context keep memory and startup low; the same settings for the oracle.
ENGINE_FLAGS = dict(max_num_seqs=32, max_num_batched_tokens=512, max_model_len=512,
                    num_blocks=512, block_size=16, seed=0)
STARTUP_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli_flags(**engine) -> list[str]:
    return [f"--{k.replace('_', '-')}={v}" for k, v in engine.items()]


@dataclass
class ServerProcess:
    url: str  # http://127.0.0.1:PORT
    proc: subprocess.Popen
    log_path: Path

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def client(self, **kwargs):
        import openai

        return openai.OpenAI(base_url=self.base_url, api_key="x", max_retries=0, **kwargs)

    def async_client(self, **kwargs):
        import openai

        return openai.AsyncOpenAI(base_url=self.base_url, api_key="x", max_retries=0, **kwargs)

    def metrics(self) -> dict[str, float]:
        """Samples of /metrics: 'name' or 'name{label="value"}' -> value."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        samples = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return samples

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        pytest.fail(f"server not ready after {timeout}s:\n{self.log()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # uvicorn's graceful shutdown
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def launch_server(log_dir: Path, *flags: str) -> ServerProcess:
    """Start `python -m slotserve.cli serve` (not waiting for it to be ready)."""
    port = free_port()
    log_path = log_dir / f"server-{port}.log"
    cmd = [sys.executable, "-m", "slotserve.cli", "serve", "--host", "127.0.0.1",
           "--port", str(port), *flags]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
    return ServerProcess(f"http://127.0.0.1:{port}", proc, log_path)


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
