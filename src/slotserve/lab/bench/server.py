"""`slotserve serve` as a subprocess on a free loopback port, and waiting for any server's
/health: for benchmarks and end-to-end tests, which talk to a real server over HTTP.

    server = ServerProcess.launch(Path("server.log"), *cli_flags(max_num_seqs=8))
    server.wait_ready()
    ...  # requests to server.url
    server.stop()
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

HOST = "127.0.0.1"
STARTUP_TIMEOUT_S = 300.0  # loading the model (and its tokenizer cache) on a slow CPU
STOP_TIMEOUT_S = 60.0  # SIGTERM drains running requests first


class ServerStartError(RuntimeError):
    """The server exited, or did not answer /health in time; the message ends with its log."""


def wait_healthy(url: str, timeout: float, exited: Callable[[], bool],
                 log: Callable[[], str], poll_s: float = 0.3) -> None:
    """Return once `url`/health answers 200. ServerStartError if `exited()` says the
    server's process is gone, or after `timeout` seconds; its message ends with `log()`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if exited():
            raise ServerStartError(f"{url} exited:\n{log()}")
        if healthy(url):
            return
        time.sleep(poll_s)
    raise ServerStartError(f"{url} not ready after {timeout}s:\n{log()}")


def healthy(url: str) -> bool:
    """Whether `url`/health answers 200 now."""
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def free_port() -> int:
    """A loopback port nothing listens on now (the OS picks it)."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def scrape_metrics(url: str, timeout: float = 10.0,
                   headers: dict[str, str] | None = None) -> dict[str, float]:
    """Samples of a server's /metrics: 'name' or 'name{label="value",...}' -> value.
    headers: e.g. the admin key's Authorization when the server has keys."""
    from prometheus_client.parser import text_string_to_metric_families

    response = httpx.get(url + "/metrics", timeout=timeout, headers=headers)
    response.raise_for_status()
    text = response.text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


def cli_flags(**engine) -> list[str]:
    """`serve` flags from keyword arguments: max_num_seqs=8 -> "--max-num-seqs=8"."""
    return [f"--{k.replace('_', '-')}={v}" for k, v in engine.items()]


@dataclass
class ServerProcess:
    """A started `slotserve serve`; its stdout and stderr go to log_path."""

    url: str  # http://127.0.0.1:PORT
    proc: subprocess.Popen
    log_path: Path

    @classmethod
    def launch(cls, log_path: Path, *flags: str, port: int | None = None,
               cwd: Path | None = None, env: dict[str, str] | None = None) -> ServerProcess:
        """Start `python -m slotserve.cli serve` on loopback (not waiting for it to be ready).

        port: None picks a free one. flags: more `serve` flags (see cli_flags). env: variables
        set beside this process's (e.g. PYTHONPATH: another checkout's slotserve).
        """
        port = port or free_port()
        cmd = [sys.executable, "-m", "slotserve.cli", "serve", "--host", HOST,
               "--port", str(port), *flags]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, env=env)
        return cls(f"http://{HOST}:{port}", proc, Path(log_path))

    @property
    def base_url(self) -> str:
        """The OpenAI API's base URL (for openai.OpenAI(base_url=...))."""
        return self.url + "/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        """Return once /health answers 200; ServerStartError if the server exits first or
        the timeout passes (the process is left running then: stop() it)."""
        wait_healthy(self.url, timeout, lambda: self.proc.poll() is not None,
                     lambda: self.log()[-3000:])

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM (a graceful shutdown), SIGKILL after `timeout`; the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode
