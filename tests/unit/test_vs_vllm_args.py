"""benchmarks.vs_vllm's command line: systems (with a forced CPU class), workloads, models,
and the targets grouped by CPU class. Nothing is started or timed."""

import json
import re
import subprocess
import sys

import pytest

from benchmarks.vs_vllm import (
    MODELS,
    SYSTEMS,
    class_of,
    parse_args,
    parse_system,
    parse_systems,
    scaled_w,
    targets_by_class,
    workload,
)
from slotserve.model.kernels import CPU_CLASSES


def test_plain_names_are_the_systems_keys_in_any_spelling():
    for text in ("slotserve bf16", "slotserve-bf16", "SlotServe_BF16", " slotserve  bf16 "):
        spec = parse_system(text)
        assert (spec.name, spec.base, spec.kind, spec.cpu_isa) == (
            "slotserve bf16", "slotserve bf16", "slotserve", None)
        assert spec.how == {"quantization": "bf16"}
    vllm = parse_system("vllm-fp32")
    assert (vllm.name, vllm.kind, vllm.how) == ("vLLM fp32", "vllm", "float32")


def test_a_forced_class_names_the_row_and_sets_the_class():
    spec = parse_system("slotserve-bf16@avx2")
    assert spec.name == "slotserve bf16@avx2" and spec.base == "slotserve bf16"
    assert spec.cpu_isa == "avx2" and spec.how == SYSTEMS["slotserve bf16"][1]
    assert parse_system("slotserve fp32@AVX512BF16").cpu_isa == "avx512bf16"
    assert {parse_system(f"slotserve int8@{c}").cpu_isa for c in CPU_CLASSES} == set(CPU_CLASSES)
    vllm = parse_system("vllm-bf16@avx2")  # serve.sh's FORCE_CPU_ISA
    assert (vllm.name, vllm.kind, vllm.how, vllm.cpu_isa) == (
        "vLLM bf16@avx2", "vllm", "bfloat16", "avx2")
    assert parse_system("vLLM fp32@AVX512").cpu_isa == "avx512"
    assert parse_system("vLLM bf16@avx512bf16").cpu_isa == "avx512bf16"


@pytest.mark.parametrize("text, words", [
    ("slotserve bf17", "unknown system"),
    ("llama.cpp", "unknown system"),
    ("slotserve bf16@avx3", "unknown CPU class"),
    ("vLLM bf16@amx", "avx2, avx512, avx512bf16 only"),
    ("vLLM fp32@generic", "avx2, avx512, avx512bf16 only"),
])
def test_bad_systems_are_refused_naming_them(text, words):
    with pytest.raises(ValueError, match=words):
        parse_system(text)


def test_systems_list_keeps_order_and_refuses_repeats():
    specs = parse_systems("slotserve-bf16@avx2,slotserve fp32@avx2,vLLM bf16,vLLM fp32")
    assert [s.name for s in specs] == ["slotserve bf16@avx2", "slotserve fp32@avx2",
                                       "vLLM bf16", "vLLM fp32"]
    with pytest.raises(ValueError, match="more than once"):
        parse_systems("slotserve bf16,slotserve-bf16")
    assert [s.name for s in parse_systems("slotserve bf16,slotserve bf16@avx2")] == [
        "slotserve bf16", "slotserve bf16@avx2"]  # two classes: two systems
    with pytest.raises(ValueError, match="no system"):
        parse_systems(" , ")


def test_defaults_are_todays_run():
    args = parse_args([])
    assert [s.name for s in args.specs] == list(SYSTEMS)
    assert args.model == "smollm2" and args.model_choice.output_scale == 1.0
    assert args.in_turn is False and args.no_quality is False and args.rounds == 2
    assert args.wnames == ["W", "W 2/s", "W 4/s", "batch-1"]


def test_llama1b_skips_quality_and_starts_servers_in_turn():
    args = parse_args(["--model", "llama1b"])
    assert args.no_quality is True and args.in_turn is True
    assert args.model_choice.slotserve_model == str(args.model_choice.hf_dir)
    assert parse_args(["--model", "llama1b", "--no-in-turn"]).in_turn is False


@pytest.mark.parametrize("argv", [["--systems", "vLLM int8"], ["--workloads", "W,W 8/s"],
                                  ["--model", "llama7b"], ["--rounds", "0"],
                                  ["--systems", "vLLM bf16@generic"]])
def test_bad_command_lines_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(argv)
    assert exit_.value.code == 2 and "error" in capsys.readouterr().err


def test_llama1b_workloads_are_w_with_quarter_outputs():
    w, short = workload("W"), workload("W", MODELS["llama1b"].output_scale)
    assert len(short.requests) == len(w.requests) == 64
    assert [r.messages for r in short.requests] == [r.messages for r in w.requests]
    for full, quarter in zip(w.requests, short.requests):  # the same draws, a quarter
        assert abs(quarter.max_tokens - full.max_tokens / 4) <= 1
        assert 2 <= quarter.max_tokens <= 96
    assert sum(r.max_tokens for r in short.requests) < sum(r.max_tokens for r in w.requests) / 3
    online = scaled_w(2.0, 0.25)
    assert [r.arrival for r in online.requests] == [r.arrival for r in workload("W 2/s").requests]
    assert max(r.arrival for r in online.requests) > 0 == max(r.arrival for r in short.requests)
    assert workload("batch-1", 0.25).requests[0].max_tokens == 128


def _row(system, tok_s, p50=10.0, p99=12.0):
    return {"system": system, "W": {"output_tok_s": tok_s, "tpot_p50_ms": p50,
                                    "tpot_p99_ms": p99}}


def test_targets_are_grouped_by_cpu_class():
    rows = [_row("slotserve bf16", 130.0), _row("slotserve fp32", 90.0),
            _row("slotserve bf16@avx2", 50.0, 20.0, 40.0), _row("slotserve fp32@avx2", 60.0),
            _row("vLLM bf16", 100.0), _row("vLLM fp32", 70.0)]
    assert class_of("slotserve bf16@avx2") == "avx2" and class_of("vLLM bf16") is None
    out = targets_by_class(rows)
    assert out["W output_tok_s"]["x_better"] == 1.3
    assert out["W output_tok_s"]["slotserve"] == ("slotserve bf16", 130.0)
    assert out["fp32 W tok/s"] == {"slotserve fp32": 90.0, "vLLM fp32": 70.0}
    forced = out["CPU class avx2 (forced)"]
    assert forced["W output_tok_s"]["slotserve"] == ("slotserve fp32", 60.0)
    assert forced["W output_tok_s"]["x_better"] == 0.6
    assert forced["W TPOT p99/p50"]["slotserve bf16"] == 2.0
    assert forced["vLLM rows"] == ["vLLM bf16", "vLLM fp32"]  # none forced: vLLM's own
    assert "slotserve bf16@avx2" not in out["W TPOT p99/p50"]


def test_a_forced_class_is_compared_with_vllm_forced_to_it():
    rows = [_row("slotserve bf16", 130.0), _row("slotserve fp32@avx2", 60.0),
            _row("vLLM bf16", 100.0), _row("vLLM bf16@avx2", 40.0), _row("vLLM fp32@avx2", 30.0)]
    out = targets_by_class(rows)
    assert out["W output_tok_s"]["vLLM"] == ("vLLM bf16", 100.0)  # the CPU's own class
    forced = out["CPU class avx2 (forced)"]
    assert forced["vLLM rows"] == ["vLLM bf16@avx2", "vLLM fp32@avx2"]
    assert forced["W output_tok_s"]["x_better"] == 1.5
    assert forced["fp32 W tok/s"] == {"slotserve fp32": 60.0, "vLLM fp32": 30.0}


def test_a_forced_class_limits_the_libraries_as_the_vllm_peer_does():
    """slotserve@avx2 runs torch's, oneDNN's and MKL's AVX2 code, as serve.sh's
    FORCE_CPU_ISA=avx2 makes vLLM's (the same three variables); so for each class."""
    from pathlib import Path

    from benchmarks.vs_vllm import LIBRARY_ISA_ENV, PEER_DIR, VLLM_CLASSES

    avx2 = LIBRARY_ISA_ENV["avx2"]
    assert avx2 == {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                    "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    serve = Path(PEER_DIR / "serve.sh").read_text()
    for isa in VLLM_CLASSES:  # each class serve.sh forces sets the same variables there
        case = serve[serve.index(f"\n  {isa})"):]
        case = case[:case.index(";;")]
        assert sorted(re.findall(r"(\w+)=(\w+)", case)) == sorted(LIBRARY_ISA_ENV[isa].items())
    assert set(LIBRARY_ISA_ENV) < set(CPU_CLASSES)


@pytest.mark.parametrize("isa, off, kept", [
    ("avx2", ["_is_avx512_supported", "_is_avx512_bf16_supported", "_is_amx_tile_supported"], []),
    ("avx512", ["_is_avx512_bf16_supported", "_is_amx_tile_supported"],
     ["_is_avx512_supported"]),
    ("avx512bf16", ["_is_amx_tile_supported"],
     ["_is_avx512_supported", "_is_avx512_bf16_supported"]),
])
def test_the_vllm_peer_sees_the_forced_class_in_torchs_cpu_checks(isa, off, kept):
    """force_isa/sitecustomize.py, which serve.sh puts first on vLLM's PYTHONPATH: the checks
    vLLM picks its kernels by answer False for what the class lacks, as the CPU does for
    the rest."""
    from benchmarks.vs_vllm import PEER_DIR

    script = ("import json, torch.cpu; "
              f"print(json.dumps({{n: getattr(torch.cpu, n)() for n in {off + kept!r}}}))")
    env = {"PYTHONPATH": str(PEER_DIR / "force_isa"), "PATH": "/usr/bin:/bin"}
    forced = subprocess.run([sys.executable, "-c", script], env={**env, "FORCE_CPU_ISA": isa},
                            capture_output=True, text=True, check=True).stdout
    own = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, check=True).stdout
    forced, own = json.loads(forced), json.loads(own)
    assert not any(forced[name] for name in off)
    assert {name: forced[name] for name in kept} == {name: own[name] for name in kept}
