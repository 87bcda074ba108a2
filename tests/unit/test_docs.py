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
