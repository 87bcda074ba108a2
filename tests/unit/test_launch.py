"""tests.support.launch without a model: ports, flags, a server that cannot start."""

from __future__ import annotations

import socket

import pytest

from tests.support.launch import ServerProcess, ServerStartError, cli_flags, free_port


def test_free_port_is_bindable_on_loopback():
    with socket.socket() as s:
        s.bind(("127.0.0.1", free_port()))


def test_cli_flags():
    assert cli_flags(max_num_seqs=8, seed=0) == ["--max-num-seqs=8", "--seed=0"]


def test_a_server_that_exits_is_reported_with_its_log(tmp_path):
    server = ServerProcess.launch(tmp_path / "server.log", "--no-such-flag")
    with pytest.raises(ServerStartError, match="no-such-flag"):
        server.wait_ready(timeout=60)
    assert server.stop() == 2  # argparse's usage error
    assert server.url.startswith("http://127.0.0.1:") and server.base_url.endswith("/v1")
