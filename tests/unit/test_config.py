"""One set of engine defaults, flags generated from the config dataclasses, the str enums."""

from __future__ import annotations

import argparse
import enum
import json
from dataclasses import dataclass, field
from typing import Literal

import pytest

import slotserve
from slotserve.cli import build_parser, main
from slotserve.config import (
    DEFAULT_QUANTIZATION,
    CacheConfig,
    EngineConfig,
    FinishReason,
    Policy,
    SchedulerConfig,
    SlotKind,
    engine_config,
    engine_fields,
    values,
)
from slotserve.engine_args import add_config_flags, engine_config_from_args, settings_from_args
from slotserve.flat_config import build_flat, flat_fields


def captured_engine_config(monkeypatch, build) -> EngineConfig:
    """The EngineConfig `build()` hands to LLMEngine.from_config (no model is loaded)."""
    from slotserve.engine.llm_engine import LLMEngine

    seen = []
    monkeypatch.setattr(LLMEngine, "from_config", staticmethod(lambda cfg: seen.append(cfg)))
    build()
    assert len(seen) == 1
    return seen[0]


def test_engine_config_llm_and_serve_build_the_same_engine(monkeypatch):
    from slotserve.engine_args import build_engine

    reference = EngineConfig()
    # NOTE: `make serve`'s defaults (the CLI's) are the one set.
    assert (reference.scheduler.max_num_seqs, reference.scheduler.max_num_batched_tokens,
            reference.scheduler.max_model_len) == (32, 512, 4096)
    assert reference.scheduler == SchedulerConfig() and reference.cache == CacheConfig()
    assert reference.quantization == DEFAULT_QUANTIZATION  # one constant: "auto" or "none"
    assert engine_config() == reference
    assert captured_engine_config(monkeypatch, slotserve.LLM) == reference
    serve_args = build_parser().parse_args(["serve"])
    assert engine_config_from_args(serve_args) == reference
    assert captured_engine_config(monkeypatch, lambda: build_engine(serve_args)) == reference
    for argv in (["generate", "hi"], ["bench"]):
        assert engine_config_from_args(build_parser().parse_args(argv)) == reference


@pytest.mark.parametrize("weights", ["auto", "none", "bf16", "int8"])
def test_every_quantization_is_one_flag_away(weights):
    args = build_parser().parse_args(["serve", "--quantization", weights])
    assert engine_config_from_args(args) == engine_config(quantization=weights)
    assert engine_config(quantization=weights).quantization == weights


def test_chat_keeps_its_one_slot_default():
    args = build_parser().parse_args(["chat"])
    assert engine_config_from_args(args) == engine_config(max_num_seqs=1)


@pytest.mark.parametrize("flags,expected", [
    (["--model", "m.gguf"], {"model": "m.gguf"}),
    (["--device", "cuda", "--dtype", "bfloat16"], {"device": "cuda", "dtype": "bfloat16"}),
    (["--batching", "static"], {"batching": Policy.STATIC}),
    (["--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--max-model-len", "128"],
     {"max_num_seqs": 4, "max_num_batched_tokens": 64, "max_model_len": 128}),
    (["--block-size", "8", "--num-blocks", "100"], {"block_size": 8, "num_blocks": 100}),
    (["--kv-cache-memory", "1G"], {"kv_cache_memory": 1 << 30}),
    (["--quantization", "int8", "--kernels", "mkl", "--seed", "3"],
     {"quantization": "int8", "kernels": "mkl", "seed": 3}),
    (["--no-enable-prefix-caching"], {"enable_prefix_caching": False}),
    (["--quantization", "bf16"], {"quantization": "bf16"}),
    (["--max-waiting", "5"], {"max_waiting": 5}),  # serve's own flag, a scheduler setting
    (["--max-prefill-tokens-while-decoding", "32"], {"max_prefill_tokens_while_decoding": 32}),
])
def test_engine_flags_keep_their_names_and_meanings(flags, expected):
    """The flags README.md lists, each landing in its EngineConfig field."""
    config = engine_config_from_args(build_parser().parse_args(["serve", *flags]))
    assert config == engine_config(**expected)
    assert config != EngineConfig()


@pytest.mark.parametrize("argv,flag", [
    (["serve", "--max-num-seqs", "many"], "--max-num-seqs"),  # argparse: not an int
    (["serve", "--policy", "fifo"], "--policy"),  # argparse: not a choice
    (["generate", "hi", "--kv-cache-memory", "12Q"], "--kv-cache-memory"),
    (["serve", "--max-num-seqs", "0"], "--max-num-seqs"),  # the dataclass: must be >= 1
    (["bench", "--block-size", "0"], "--block-size"),
    (["generate", "hi", "--kv-cache-memory", "0"], "--kv-cache-memory"),  # memory_bytes
    (["serve", "--device", "cuda", "--quantization", "int8"], "--quantization"),
    (["serve", "--max-prefill-tokens-while-decoding", "0"],
     "--max-prefill-tokens-while-decoding"),
])
def test_bad_flag_values_are_argparse_errors_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert f"argument {flag}:" in capsys.readouterr().err


class Mode(str, enum.Enum):
    FAST = "fast"
    SLOW = "slow"


@dataclass(frozen=True)
class DummySection:
    """A nested section.

    new_field: a setting added later; its flag
        comes from this entry.
    ratio / scale: two settings, one entry.
    """

    new_field: int = 7
    ratio: float | None = None
    scale: float = 1.0


@dataclass(frozen=True)
class DummyConfig:
    """A root config.

    name: a name.
    """

    name: str = "x"
    level: Literal[1, 2, 3] = 1
    mode: Mode = Mode.FAST
    verbose: bool = False
    pairs: tuple[tuple[str, float], ...] = ()  # no one-flag form: no flag
    hidden: int = field(default=1, metadata={"flag": False})
    renamed: int | None = field(default=None, metadata={"name": "other_name"})
    section: DummySection = field(default_factory=DummySection)


def dummy_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_config_flags(parser, flat_fields(DummyConfig).values())
    return parser


def dummy_config(argv: list[str]) -> DummyConfig:
    args = dummy_parser().parse_args(argv)
    return build_flat(DummyConfig, **settings_from_args(args, flat_fields(DummyConfig)))


def test_a_new_field_gets_a_flag():
    assert dummy_config([]) == DummyConfig()
    config = dummy_config(["--new-field", "9", "--ratio", "0.5", "--name", "y", "--level", "3",
                           "--mode", "slow", "--verbose", "--other-name", "4"])
    assert config == DummyConfig(name="y", level=3, mode=Mode.SLOW, verbose=True, renamed=4,
                                 section=DummySection(new_field=9, ratio=0.5))
    options = {o for a in dummy_parser()._actions for o in a.option_strings}
    assert {"--pairs", "--hidden", "--renamed", "--section"}.isdisjoint(options)
    assert {"--no-verbose", "--scale"} <= options
    helps = {a.dest: a.help for a in dummy_parser()._actions}
    assert helps["new_field"] == "a setting added later; its flag comes from this entry " \
                                 "(default: %(default)s)"
    assert helps["ratio"].startswith("two settings, one entry") and helps["scale"]


def test_dummy_flags_reject_bad_values():
    for argv in (["--new-field", "x"], ["--level", "4"], ["--mode", "medium"]):
        with pytest.raises(argparse.ArgumentError, match=argv[0]):
            dummy_parser().parse_args(argv)


def test_two_settings_with_one_flat_name_are_refused():
    @dataclass
    class Clash:
        block_size: int = 1
        cache: CacheConfig = field(default_factory=CacheConfig)

    with pytest.raises(ValueError, match="block_size"):
        flat_fields(Clash)


def test_engine_config_refuses_unknown_settings():
    with pytest.raises(TypeError, match="max_num_seq"):
        engine_config(max_num_seq=4)
    assert engine_config(kv_cache_memory=1024).cache.memory_bytes == 1024
    assert set(engine_fields()) >= {"max_num_seqs", "kv_cache_memory", "batching", "kernels"}


def test_str_enums_behave_as_their_strings():
    config = SchedulerConfig(policy="static")
    assert config.policy is Policy.STATIC and config.policy == "static"
    assert f"{config.policy}" == str(config.policy) == "static"
    assert "%s" % Policy.STATIC == "static"  # noqa: UP031 (as logging formats it)
    assert json.dumps({"kind": SlotKind.STALLED}) == '{"kind": "stalled"}'
    assert values(Policy) == ("continuous", "static")
    with pytest.raises(ValueError, match="policy must be one of"):
        SchedulerConfig(policy="fifo")


def test_finish_reasons_are_the_request_statuses_finished_values():
    from slotserve.request import RequestStatus

    assert set(values(FinishReason)) == {s.value for s in RequestStatus if s.finished}


def test_slot_kinds_are_the_kinds_the_scheduler_writes():
    from slotserve.core.kv_manager import KVCacheManager
    from slotserve.core.outputs import RunnerOutput
    from slotserve.core.scheduler import Scheduler
    from slotserve.request import Request
    from slotserve.sampling import SamplingParams

    # static, two 6-token prompts and a 4-token budget: one prefills, the other stalls.
    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=4, policy=Policy.STATIC)
    sched = Scheduler(config, KVCacheManager(32, 4))
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    for rid in "ab":
        sched.add_request(Request(rid, list(range(1, 7)), params))
    seen = set()
    while sched.has_unfinished():
        plan = sched.schedule()
        seen |= {slot.kind for slot in plan.slots if slot is not None}
        seen |= {seq.kind for seq in plan.seqs}
        sched.update(plan, RunnerOutput(sampled={s.request_id: 7 for s in plan.seqs
                                                 if s.sample}))
    assert seen == set(values(SlotKind))
