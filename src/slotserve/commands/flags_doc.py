"""docs/flags.md: every command's flags, written from the parser that `--help` prints.

    python -m slotserve.commands.flags_doc > docs/flags.md

The engine flags (one per EngineConfig field, their help from the config's docstrings) are
listed once; each command then lists its own. tests/unit/test_docs.py fails when the file
is stale.
"""

from __future__ import annotations

import argparse
import sys

ENGINE_GROUP = "engine"
CHOICE_SEPARATOR = "\\|"  # a "|" inside a Markdown table cell
HEADER = """# Flags

Every flag of every `slotserve` command, as `slotserve COMMAND --help` prints it. Written by
`python -m slotserve.commands.flags_doc > docs/flags.md` (a test fails when it is stale).
"""


def flags_markdown() -> str:
    """The whole page: the engine flags once, then each command's own."""
    from slotserve.cli import build_parser  # NOTE: cli imports every command module

    action = next(a for a in build_parser()._actions
                  if isinstance(a, argparse._SubParsersAction))
    commands = dict(action.choices)
    summaries = {choice.dest: choice.help or "" for choice in action._choices_actions}
    parts = [HEADER, _engine_section(commands)]
    parts += [_command_section(name, parser, summaries.get(name, ""))
              for name, parser in commands.items()]
    return "\n".join(parts)


def _engine_section(commands: dict[str, argparse.ArgumentParser]) -> str:
    users = [name for name, p in commands.items() if _group(p, ENGINE_GROUP) is not None]
    group = _group(commands[users[0]], ENGINE_GROUP)
    intro = (f"## Engine flags\n\nShared by {', '.join(f'`{n}`' for n in users)}: one flag "
             "per engine setting (`slotserve.config`), its help from the setting's docstring.\n")
    return intro + "\n" + _table(group._group_actions)


def _command_section(name: str, parser: argparse.ArgumentParser, summary: str) -> str:
    lines = [f"## `slotserve {name}`\n", (parser.description or summary).strip() + "\n"]
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if not isinstance(a, argparse._HelpAction)]
        if group.title == ENGINE_GROUP or not actions:
            continue
        lines.append(f"{group.title.capitalize()}:\n")
        lines.append(_table(actions))
    return "\n".join(line for line in lines if line.strip()) + "\n"


def _group(parser: argparse.ArgumentParser, title: str):
    return next((g for g in parser._action_groups if g.title == title), None)


def _table(actions: list[argparse.Action]) -> str:
    rows = ["| flag | default | what it does |", "| --- | --- | --- |"]
    rows += [f"| {_spelling(a)} | {_default(a)} | {_help(a)} |" for a in actions]
    return "\n".join(rows) + "\n"


def _spelling(action: argparse.Action) -> str:
    names = ", ".join(action.option_strings) or action.dest
    if action.choices and not isinstance(action.choices, dict):
        choices = CHOICE_SEPARATOR.join(map(str, action.choices))
        return f"`{names}` {{{choices}}}"
    if action.nargs == 0:
        return f"`{names}`"
    metavar = action.metavar or (action.dest.upper() if action.option_strings else None)
    return f"`{names} {metavar}`" if metavar else f"`{names}`"


def _default(action: argparse.Action) -> str:
    if action.default in (None, argparse.SUPPRESS) or action.nargs == 0:
        return ""
    if action.default == [] or action.default == "":
        return ""
    return f"`{action.default}`"


def _help(action: argparse.Action) -> str:
    text = (action.help or "").replace("%%", "%")
    if "%(default)s" in text:
        text = text.replace("%(default)s", str(action.default))
    return " ".join(text.split()).replace("|", "\\|")


def main() -> int:
    sys.stdout.write(flags_markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
