"""The README's quick start runs as printed, and every code block in README.md and docs/
either runs here or is marked `<!-- illustrative -->` on the line before it.

Blocks without a language are text (diagrams, tables of output) and are not code. A `sh`
block runs when every command in it is `curl`; a `python` block runs as a script. Both run
against a real server, the printed address (127.0.0.1:8000) replaced by the test server's.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.e2e.conftest import ENGINE_FLAGS, running_server
from tests.support.launch import cli_flags

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
ILLUSTRATIVE = "<!-- illustrative -->"
PRINTED_ADDRESS = "127.0.0.1:8000"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    language: str
    code: str
    illustrative: bool

    @property
    def runnable(self) -> bool:
        if self.language == "python":
            return True
        return self.language == "sh" and all(cmd.startswith("curl ") for cmd in _commands(self))


def _commands(block: Block) -> list[str]:
    joined = block.code.replace("\\\n", " ")
    return [line.strip() for line in joined.splitlines() if line.strip()]


def blocks(path: Path) -> list[Block]:
    text = path.read_text()
    found = []
    for match in FENCE.finditer(text):
        before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        found.append(Block(path.name, text.count("\n", 0, match.start()) + 1, match.group(1),
                           match.group(2), before.strip() == ILLUSTRATIVE))
    return found


ALL_BLOCKS = [block for page in PAGES for block in blocks(page)]


def test_every_code_block_runs_or_is_marked_illustrative():
    unmarked = [f"{b.page}:{b.line}" for b in ALL_BLOCKS
                if b.language and not b.illustrative and not b.runnable]
    assert not unmarked, f"code blocks neither runnable here nor marked {ILLUSTRATIVE}: {unmarked}"
    assert any(b.runnable for b in blocks(REPO / "README.md"))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("readme"), *cli_flags(**ENGINE_FLAGS)) as proc:
        yield proc


RUNNABLE = [b for b in ALL_BLOCKS if b.runnable and not b.illustrative]


@pytest.mark.parametrize("block", RUNNABLE, ids=[f"{b.page}:{b.line}" for b in RUNNABLE])
def test_code_block_runs_as_printed(block, server, tmp_path):
    code = block.code.replace(PRINTED_ADDRESS, server.url.removeprefix("http://"))
    if block.language == "python":
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=300, cwd=tmp_path)
    else:
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", code], capture_output=True,
                              text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip(), "the block printed nothing"
    if block.language == "sh":
        answer = json.loads(done.stdout)
        assert answer["choices"][0]["message"]["content"], answer
