"""benchmarks/gpu_check.py's dry run: every step of the GPU machine's check at tiny sizes on
the CPU through Triton's interpreter, so the script that device time is spent on runs."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("triton")


# ~6 s in the interpreter
def test_the_gpu_check_runs_every_step_in_a_dry_run(tmp_path, device):
    if device.type != "cpu":
        pytest.skip("the dry run is the interpreter's")
    from benchmarks import gpu_check

    assert gpu_check.main(["--dry-run", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu-check-dry.json").read_text())
    assert report["copy_bandwidth"]["gb_per_s"] > 0
    decode = report["decode_attention"]
    assert [(r["seqs"], r["context"], r["window"]) for r in decode] == \
        gpu_check.DRY_DECODE_CASES
    assert all(r["triton_w4_rel_error"] < 1e-2 for r in decode)  # bf16 against fp32
    ops = {r["op"] for r in report["elementwise"]}
    assert ops == {"rms_norm", "add_rms_norm", "silu_mul", "rotary", "write_kv"}
    assert all(r.get("rel_error", 0) < 1e-2 for r in report["elementwise"])
    equality = report["engine_hf_equality"]
    assert "error" not in equality, equality.get("error")
    assert equality["fp32_identical_sequences"] == equality["prompts"]
    assert 0 < equality["bf16_teacher_forced_agreement"] <= 1
    engine = report["engine_dry"]
    assert "error" not in engine, engine.get("error")
    assert engine["graphs"]["batch_1"]["tpot_ms"] > 0
    assert [r["slots"] for r in engine["graphs"]["full"]] == [2, 4]
    assert all(r["output_tok_per_s"] > 0 for r in engine["graphs"]["full"])
    assert engine["eager"]["batch_1"]["tpot_ms"] > 0
