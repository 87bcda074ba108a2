"""docs/flags.md is what the parser prints today."""

from __future__ import annotations

from pathlib import Path

from slotserve.commands.flags_doc import flags_markdown

FLAGS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "flags.md"


def test_flags_page_is_current():
    assert FLAGS_PAGE.read_text() == flags_markdown(), (
        "docs/flags.md is stale: python -m slotserve.commands.flags_doc > docs/flags.md")


def test_flags_page_lists_every_serve_flag():
    from slotserve.cli import build_parser

    text = FLAGS_PAGE.read_text()
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    flags = [s for a in serve._actions for s in a.option_strings if s.startswith("--")]
    missing = [flag for flag in flags if flag != "--help"
               and f"`{flag}" not in text and f", {flag}" not in text]
    assert not missing


def test_nothing_points_outside_the_repository():
    """The project stands alone: no path into a sibling folder or this machine's layout."""
    import subprocess

    repo = FLAGS_PAGE.parents[1]
    files = subprocess.run(["git", "ls-files"], cwd=repo, capture_output=True, text=True,
                           check=True).stdout.split()
    outside = ("../shared", "/work/")
    offenders = [name for name in files
                 if name.endswith((".py", ".md", ".sh", ".toml", "Makefile", ".js", ".html"))
                 and name != "tests/unit/test_docs.py"
                 and any(marker in (repo / name).read_text(errors="replace")
                         for marker in outside)]
    assert offenders == []
