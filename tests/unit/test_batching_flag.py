"""The admission rule's setting is `batching` (--batching): "policy" also named the queue
order (issue 33). The old name stays for a release: `policy=` / --policy set the same
setting, with a warning."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import pytest

from slotserve.cli import build_parser
from slotserve.config import Policy, engine_config, engine_fields
from slotserve.engine_args import engine_config_from_args
from slotserve.flat_config import build_flat, deprecated_names, flat_fields


def test_batching_is_the_setting_and_policy_its_deprecated_name():
    leaf = engine_fields()["batching"]
    assert (leaf.section, leaf.attr, leaf.default) == ("scheduler", "policy", Policy.CONTINUOUS)
    assert "policy" not in engine_fields()
    assert deprecated_names(engine_fields()) == {"policy": "batching"}


def test_the_new_name_sets_it_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert engine_config(batching="static").scheduler.policy is Policy.STATIC


def test_the_old_name_sets_it_with_a_deprecation_warning():
    with pytest.warns(DeprecationWarning, match="'policy' is deprecated: use 'batching'"):
        config = engine_config(policy="static")
    assert config == engine_config(batching="static")


def test_both_names_at_once_are_refused():
    with pytest.raises(TypeError, match="batching given twice"):
        engine_config(batching="static", policy="continuous")


def test_a_bad_value_under_either_name_names_the_field():
    with pytest.raises(ValueError, match="policy must be one of"):
        engine_config(batching="fifo")


def test_the_batching_flag_sets_it_silently(capsys):
    args = build_parser().parse_args(["serve", "--batching", "static"])
    assert args.batching == "static"
    assert engine_config_from_args(args).scheduler.policy is Policy.STATIC
    assert "deprecated" not in capsys.readouterr().err


def test_the_policy_flag_still_works_with_a_warning(capsys):
    args = build_parser().parse_args(["serve", "--policy", "static", "--max-num-seqs", "4"])
    assert args.batching == "static" and not hasattr(args, "policy")
    assert engine_config_from_args(args) == engine_config(batching="static", max_num_seqs=4)
    assert "warning: --policy is deprecated; use --batching" in capsys.readouterr().err


def test_without_either_flag_the_default_holds():
    args = build_parser().parse_args(["serve"])
    assert args.batching == "continuous"


def test_help_lists_batching_and_the_alias_as_deprecated(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    out = capsys.readouterr().out
    assert "--batching {continuous,static}" in out
    assert "--policy {continuous,static}" in out and "deprecated: use --batching" in out


def test_a_deprecated_name_may_not_be_another_settings_name():
    @dataclass(frozen=True)
    class Clash:
        a: int = field(default=1, metadata={"deprecated_names": ("b",)})
        b: int = 2

    with pytest.raises(ValueError, match="deprecated name 'b' is another setting's name"):
        flat_fields(Clash)


@dataclass(frozen=True)
class Inner:
    size: int = field(default=1, metadata={"name": "width", "deprecated_names": ("size",)})


@dataclass(frozen=True)
class Root:
    inner: Inner = field(default_factory=Inner)


def test_build_flat_renames_in_a_section():
    with pytest.warns(DeprecationWarning):
        assert build_flat(Root, size=3) == Root(Inner(3))
    assert build_flat(Root, width=4) == Root(Inner(4))
