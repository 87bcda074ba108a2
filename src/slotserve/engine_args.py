"""The CLI's engine flags, generated from the config dataclasses (see slotserve.config).

Every flat setting of EngineConfig (`config.engine_fields()`) is one flag: its name in kebab
case (`max_num_seqs` -> `--max-num-seqs`), the type from the annotation (`int | None` takes an
int; a Literal or an enum gives the choices; a bool gets `--x/--no-x`), the help from the
field's docstring entry, the default the dataclass's. So a new field gets its flag without
code here. No flag for a field whose metadata says `flag=False`, nor for a type that one flag
cannot spell (a tuple, a dict). FLAG_OVERRIDES holds what differs from the rule. A renamed
setting's former names stay flags for a release (`--policy` for `--batching`): they set the
same dest and print a warning.

    add_engine_args(parser)            # the flags, in an "engine" group
    engine_config_from_args(args)      # -> EngineConfig (nothing loaded)
    build_engine(args)                 # -> LLMEngine (the model loaded)
    check_engine_args(parser, args)    # a bad value -> an argparse error naming the flag
"""

from __future__ import annotations

import argparse
import enum
import re
import sys
from collections.abc import Iterable
from dataclasses import MISSING
from typing import Any

from slotserve.config import EngineConfig, engine_config, engine_fields
from slotserve.flat_config import FlatField

SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20,
              "mb": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}


def parse_size(text: str) -> int:
    """'512M', '2GiB', '1073741824' -> bytes."""
    value = text.strip().lower()
    number = value.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = value[len(number):].strip()
    if unit not in SIZE_UNITS or not number:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512M, 2G)")
    try:
        return int(float(number) * SIZE_UNITS[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512M, 2G)") from None


# Flags that differ from the generated rule, by flat name: argparse keywords that replace
# the generated ones.
FLAG_OVERRIDES: dict[str, dict[str, Any]] = {
    "kv_cache_memory": {"type": parse_size, "metavar": "SIZE"},  # --kv-cache-memory 1G
}


def flag_name(name: str) -> str:
    """The flag of a flat setting: `max_num_seqs` -> `--max-num-seqs`."""
    return "--" + name.replace("_", "-")


def flag_spec(leaf: FlatField) -> dict[str, Any] | None:
    """argparse keywords for a setting's flag; None if its type has no one-flag form."""
    spec: dict[str, Any] = {"help": leaf.help.replace("%", "%%").rstrip(".")}
    if leaf.default is MISSING:
        spec["required"] = True
    else:
        spec["default"] = _plain(leaf.default)
        if leaf.default is not None:
            spec["help"] += " (default: %(default)s)"
    if leaf.base_type is bool:
        return {**spec, "action": argparse.BooleanOptionalAction}
    if leaf.choices is not None:
        return {**spec, "type": type(leaf.choices[0]), "choices": list(leaf.choices)}
    if leaf.base_type in (int, float, str):
        return {**spec, "type": leaf.base_type}
    return None


def _plain(value: Any) -> Any:
    return value.value if isinstance(value, enum.Enum) else value


class DeprecatedFlag(argparse._StoreAction):
    """A setting's former flag: stores into the setting's dest, with a warning on stderr."""

    def __init__(self, option_strings, dest, new_flag: str, **kwargs) -> None:
        self.new_flag = new_flag
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(f"{parser.prog}: warning: {option_string} is deprecated; use {self.new_flag}",
              file=sys.stderr)
        super().__call__(parser, namespace, values, option_string)


def add_config_flags(parser, leaves: Iterable[FlatField],
                     overrides: dict[str, dict[str, Any]] | None = None) -> None:
    """One flag per setting of `leaves` (see the module docstring); `overrides` by flat name."""
    for leaf in leaves:
        spec = flag_spec(leaf) if leaf.flag else None
        if spec is not None:
            spec.update((overrides or {}).get(leaf.name, {}))
            parser.add_argument(flag_name(leaf.name), dest=leaf.name, **spec)
            _add_deprecated_flags(parser, leaf, spec)


def _add_deprecated_flags(parser, leaf: FlatField, spec: dict[str, Any]) -> None:
    """The setting's former flags (a flag that takes a value only; NOTE: no default: the
    setting's own flag gives it)."""
    if "action" in spec:
        return
    new = flag_name(leaf.name)
    for old in leaf.deprecated_names:
        kept = {k: v for k, v in spec.items() if k not in ("default", "required", "help")}
        parser.add_argument(flag_name(old), dest=leaf.name, action=DeprecatedFlag,
                            new_flag=new, default=argparse.SUPPRESS,
                            help=f"deprecated: use {new}", **kept)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Flags shared by every command that builds an engine (dests: engine_config's names)."""
    group = parser.add_argument_group("engine")
    add_config_flags(group, engine_fields().values(), FLAG_OVERRIDES)
    parser.set_defaults(_engine_flags=True)


def settings_from_args(args: argparse.Namespace, leaves: Iterable[str]) -> dict[str, Any]:
    """The settings among `leaves` (flat names) that `args` holds.

    NOTE: a subcommand's own flag whose dest is a flat name sets that setting too (serve's
    --max-waiting).
    """
    return {name: getattr(args, name) for name in leaves if hasattr(args, name)}


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """engine_config's keywords from the parsed flags, all but `model` (LLM's first argument)."""
    settings = settings_from_args(args, engine_fields())
    settings.pop("model", None)
    return settings


def engine_config_from_args(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    """The EngineConfig the engine flags describe (ValueError naming the field if invalid)."""
    return engine_config(getattr(args, "model", None), **{**engine_kwargs(args), **overrides})


def build_engine(args: argparse.Namespace, **overrides: Any):
    """The LLMEngine the engine flags (and serve's --max-waiting) describe; loads the model."""
    from slotserve.engine.llm_engine import LLMEngine

    return LLMEngine.from_config(engine_config_from_args(args, **overrides))


def check_engine_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """If the command has engine flags: exit with an argparse error (status 2, naming the
    flag) when they describe an invalid EngineConfig, before anything loads."""
    if not getattr(args, "_engine_flags", False):
        return
    try:
        engine_config_from_args(args)
    except ValueError as exc:
        flag = _flag_named_by(str(exc))
        parser.error(f"argument {flag}: {exc}" if flag else str(exc))


def _flag_named_by(message: str) -> str | None:
    """The flag of the setting a config ValueError names first ("max_num_seqs must ...")."""
    first = re.match(r"\w+", message)
    for leaf in engine_fields().values():
        if first and first[0] in (leaf.name, leaf.attr):
            return flag_name(leaf.name)
    return None
